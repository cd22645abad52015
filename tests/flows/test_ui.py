"""`alignflow ui`: the Prefect server and the MLflow UI come up on 127.0.0.1, print their URLs, and both stop
on SIGTERM; every socket its process tree listens on is bound to 127.0.0.1 (checked on the sockets, not the
printed URLs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from flows.deployments import csrf_headers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])  # SIGHUP: terminal closed
def test_ui_serves_prefect_and_mlflow_on_loopback_and_stops(tmp_path, subprocess_env, listening_sockets, stop):
    prefect_port, mlflow_port = free_port(), free_port()
    env = subprocess_env | {"ALIGNFLOW_HOME": str(tmp_path / "ws")}
    ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--prefect-port", str(prefect_port),
                           "--mlflow-port", str(mlflow_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any("Ctrl-C" in line for line in lines):
            line = ui.stdout.readline()
            if not line:
                break
            lines.append(line)
        output = "".join(lines)
        assert f"http://127.0.0.1:{prefect_port}" in output and f"http://127.0.0.1:{mlflow_port}" in output, output
        assert healthy(f"http://127.0.0.1:{prefect_port}/api/health")
        assert healthy(f"http://127.0.0.1:{mlflow_port}/health")
        sockets = listening_sockets(ui.pid)
        assert {prefect_port, mlflow_port} <= {port for _, port in sockets}, sockets
        assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets  # no 0.0.0.0, no ::
        # a web page open in the user's browser gets no answer it can read and changes nothing (Prefect's defaults
        # allowed every origin and took changes without a CSRF token); the UI's own origins are allowed
        api = f"http://127.0.0.1:{prefect_port}/api"
        for origin, allowed in (("https://evil.example.com", False), (f"http://localhost:{prefect_port}", True)):
            preflight = httpx.options(f"{api}/flow_runs/filter", timeout=10, headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type"})
            assert ("access-control-allow-origin" in preflight.headers) == allowed, (origin, preflight.headers)
        refused = httpx.post(f"{api}/flows/", json={"name": "planted"}, timeout=10,
                             headers={"Origin": "https://evil.example.com"})
        assert (refused.status_code, refused.json()) == (403, {"detail": "Missing CSRF token."})
        assert httpx.post(f"{api}/flows/", json={"name": "made-here"}, headers=csrf_headers(api),
                          timeout=10).status_code == 201
        # nor does a page whose host name was re-pointed at 127.0.0.1 (DNS rebinding: same-origin, so CORS and the
        # CSRF token it could read stopped nothing): a request naming another host is refused, by both servers
        rebound = {"Host": f"evil.example.com:{prefect_port}", "Origin": f"http://evil.example.com:{prefect_port}"}
        token = httpx.get(f"{api}/csrf-token", params={"client": "page"}, headers=rebound, timeout=10)
        runs = httpx.post(f"{api}/flow_runs/filter", json={}, headers=rebound, timeout=10)
        assert (token.status_code, runs.status_code) == (400, 400), (token.text, runs.text)
        assert httpx.get(f"http://127.0.0.1:{mlflow_port}/api/2.0/mlflow/experiments/search?max_results=1",
                         timeout=10, headers={"Host": f"evil.example.com:{mlflow_port}"}).status_code == 403
        assert httpx.get(f"http://localhost:{prefect_port}/api/health", timeout=10).status_code == 200
        ui.send_signal(stop)
        ui.wait(10)  # both servers stop at once (MLflow's job runner, which took up to 15 s, is not started)
        assert not healthy(f"http://127.0.0.1:{prefect_port}/api/health")
        assert not healthy(f"http://127.0.0.1:{mlflow_port}/health")
    finally:
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGKILL)


@pytest.mark.parametrize("taken", ["--prefect-port", "--mlflow-port"])
def test_a_port_in_use_is_a_one_line_error_before_any_server_starts(tmp_path, subprocess_env, taken):
    """Another workspace's UI on the port: its server answered the health check, so `alignflow ui` printed URLs
    of the other workspace's servers and quit with 0 when its own server exited."""
    ports = {"--prefect-port": free_port(), "--mlflow-port": free_port()}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[taken]))
        holder.listen()
        options = [str(x) for kv in ports.items() for x in kv]
        result = subprocess.run([sys.executable, "-m", "flows.cli", "ui", *options], capture_output=True, text=True,
                                timeout=120, env=subprocess_env | {"ALIGNFLOW_HOME": str(tmp_path / "ws")})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"error: port {ports[taken]} on 127.0.0.1 is in use (another `alignflow ui` or "
                                     f"server?); choose another with {taken}")
    assert "UI:" not in result.stdout


def test_a_port_left_in_time_wait_by_a_stopped_ui_is_free():
    """A UI stopped a moment ago leaves its accepted connections in TIME_WAIT on its ports for a minute; the servers
    bind over them (SO_REUSEADDR), so `alignflow ui` started again must not call the port in use."""
    from flows.deployments import require_free_port

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
            client.recv(1)
    require_free_port(port, "--prefect-port")
    with socket.socket() as holder:  # a port some process listens on is still refused
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(Exception, match=f"port {port} on 127.0.0.1 is in use"):
            require_free_port(port, "--prefect-port")
