"""vLLM's server on the tiny model on CPU (marked `vllm`, needs `make vllm-env`): same schema and greedy
output as HFSampler, seeded per prompt, the stage through a server URL, weight updates without a restart,
a clean stop, listening on 127.0.0.1 only; plus start-up failures reported in one line (no vLLM needed)."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import warnings

import httpx
import psutil
import pytest
import torch
from tokenizers.processors import TemplateProcessing

from pipeline_lib.config import SampleConfig
from pipeline_lib.models import load_policy, load_tokenizer, save_model
from pipeline_lib.models.loading import ModelLoadError
from pipeline_lib.sampling.base import Completion
from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.sampling.stage import run_sample_stage
from pipeline_lib.sampling.vllm import PYTHON_ENV, VLLMServer, VLLMServerError, find_vllm_python, live_group_members

PROMPTS = ["12+34=", "5+6=", "97+70="]
requires_vllm_env = pytest.mark.skipif(find_vllm_python() is None,
                                       reason=f"no vLLM env: run `make vllm-env` or set ${PYTHON_ENV}")


@pytest.fixture(scope="module")
def served_dir(tiny_model_dir, tmp_path_factory):
    """A private copy of the tiny model: the weight-update test rewrites it."""
    return shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("served") / "model")


@pytest.fixture(scope="module")
def server(served_dir):
    with VLLMServer(served_dir, max_model_len=256, weight_updates=True, startup_timeout=600) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    sampler = server.sampler()
    yield sampler
    sampler.close()


def _types(c: Completion) -> tuple:
    return (type(c.text), type(c.token_ids), frozenset(map(type, c.token_ids)), type(c.finish_reason),
            type(c.logprobs), frozenset(map(type, c.logprobs or [])))


@pytest.mark.vllm
@requires_vllm_env
def test_same_schema_as_hf_on_the_same_prompts(client, hf_sampler):
    vllm_out = client.generate(PROMPTS, n=4, max_new_tokens=6, seed=0, logprobs=True)
    hf_out = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=0, logprobs=True)
    tok = hf_sampler.tokenizer
    assert [len(g) for g in vllm_out] == [len(g) for g in hf_out] == [4, 4, 4]
    assert {_types(c) for g in vllm_out for c in g} == {_types(c) for g in hf_out for c in g}
    for group in vllm_out:
        for c in group:
            assert c.finish_reason in ("stop", "length") and 1 <= c.n_tokens <= 6
            assert (c.token_ids[-1] == tok.eos_token_id) == (c.finish_reason == "stop")
            assert tok.decode(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids) == c.text
            assert len(c.logprobs) == c.n_tokens
    # the untrained model samples special tokens mid-answer: both backends keep them in the text
    special = set(tok.all_special_ids) - {tok.eos_token_id}
    assert any(special & set(c.token_ids) for group in vllm_out for c in group)


@pytest.mark.vllm
@requires_vllm_env
@pytest.mark.parametrize("stop", [(), ("=",)], ids=["no-stop", "stop-string"])
def test_greedy_output_and_logprobs_equal_hf(client, hf_sampler, stop):
    # some greedy continuation of the (seeded, untrained) tiny model emits "=": the stop string cuts it
    vllm_out = client.generate(PROMPTS, n=2, max_new_tokens=6, temperature=0, logprobs=True, stop=stop)
    hf_out = hf_sampler.generate(PROMPTS, n=2, max_new_tokens=6, temperature=0, logprobs=True, stop=stop)
    if stop:
        assert any(c[0].finish_reason == "stop" and c[0].token_ids[-1] != hf_sampler.tokenizer.eos_token_id
                   for c in hf_out)
    for v_group, h_group in zip(vllm_out, hf_out):
        assert v_group[0] == v_group[1]
        v, h = v_group[0], h_group[0]
        assert (v.text, v.token_ids, v.finish_reason) == (h.text, h.token_ids, h.finish_reason)
        assert v.logprobs == pytest.approx(h.logprobs, abs=1e-4)


@pytest.mark.vllm
@requires_vllm_env
def test_prompts_go_as_the_token_ids_training_reads(server, hf_sampler):
    """Given the tokenizer, the sampler sends each prompt's `prompt_token_ids`: with a tokenizer appending eos to
    every text (a `<s> $A </s>` post-processor) vLLM samples after bos + the prompt, as HFSampler does and
    training reads, not after the eos the server's own tokenization would end it with."""
    tokenizer = load_tokenizer(hf_sampler.tokenizer.name_or_path)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A </s>",
                                                                    special_tokens=[("<s>", bos), ("</s>", eos)])
    sampler = server.sampler(tokenizer=tokenizer)
    try:
        vllm_out = sampler.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0, logprobs=True)
    finally:
        sampler.close()
    hf_out = HFSampler(hf_sampler.model, tokenizer).generate(PROMPTS, n=1, max_new_tokens=6, temperature=0,
                                                             logprobs=True)
    assert hf_out != hf_sampler.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0, logprobs=True)
    for [v], [h] in zip(vllm_out, hf_out):
        assert (v.text, v.token_ids, v.finish_reason) == (h.text, h.token_ids, h.finish_reason)
        assert v.logprobs == pytest.approx(h.logprobs, abs=1e-4)


@pytest.mark.vllm
@requires_vllm_env
def test_seeded_per_prompt(client):
    first = client.generate(["12+34="] * 3, n=2, max_new_tokens=6, seed=5)
    assert first == client.generate(["12+34="] * 3, n=2, max_new_tokens=6, seed=5)
    # one seed per prompt: the same prompt three times in a call gets three different random streams
    assert len({tuple(tuple(c.token_ids) for c in group) for group in first}) == 3


@pytest.mark.vllm
@requires_vllm_env
def test_stage_through_a_server_url(client, server, store, served_dir):
    cfg = SampleConfig(model_path=str(served_dir), backend="vllm", vllm_url=server.url, max_problems=4, n=3,
                       max_new_tokens=6, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the server serves model_path: nothing to warn about
        report = run_sample_stage(cfg, store, progress=False)
    rows = store.read("samples", run_id=report.run_id)
    assert rows.height == 12 and rows.select("prompt_id", "sample_idx").unique().height == 12
    assert set(rows["finish_reason"]) <= {"stop", "length"} and rows["n_tokens"].max() <= 6
    assert run_sample_stage(cfg, store, progress=False).rows_written_now == 0


@pytest.mark.vllm
@requires_vllm_env
def test_a_server_of_another_model_than_model_path_is_warned_about(server, store, served_dir, tiny_model_dir):
    """Its samples would be recorded as model_path's (run id, policy column): never silently."""
    cfg = SampleConfig(model_path=str(tiny_model_dir), backend="vllm", vllm_url=server.url, max_problems=1, n=1,
                       max_new_tokens=2)
    with pytest.warns(UserWarning, match=f"serves {served_dir}, not model_path {tiny_model_dir}: its samples are "
                                         "recorded as model_path's"):
        run_sample_stage(cfg, store, progress=False)


@pytest.mark.vllm
@requires_vllm_env
def test_server_listens_on_loopback_only(server):
    """The sockets themselves, not the URL we print: every listening socket of the server's process group."""
    group = [p for p in psutil.process_iter() if _pgid(p.pid) == server.proc.pid]
    sockets = {(c.laddr.ip, c.laddr.port) for p in group for c in p.net_connections("inet")
               if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", server.port) in sockets
    assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _perturbed(model_dir, out_dir, scale: float):
    model = load_policy(model_dir, device="cpu")
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # untied, so only the output layer changes
    return save_model(model, load_tokenizer(model_dir), out_dir)


@pytest.mark.vllm
@requires_vllm_env
def test_update_weights_changes_outputs_to_the_new_models(client, server, served_dir, tiny_model_dir, tmp_path):
    before = client.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0, logprobs=True)
    # online RL: save the policy into the served dir, then reload in place
    _perturbed(tiny_model_dir, served_dir, scale=-3.0)
    seconds = server.update_weights()
    after = client.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0, logprobs=True)
    expected = HFSampler.from_pretrained(served_dir, device="cpu").generate(
        PROMPTS, n=1, max_new_tokens=6, temperature=0, logprobs=True)
    assert after != before
    for a, e in zip(after, expected):
        assert a[0].token_ids == e[0].token_ids
        assert a[0].logprobs == pytest.approx(e[0].logprobs, abs=1e-4)
    assert seconds < 30
    # back to the original weights, reloaded from another dir
    server.update_weights(tiny_model_dir)
    restored = client.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0, logprobs=True)
    for r, b in zip(restored, before):
        assert r[0].token_ids == b[0].token_ids
        assert r[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-5)


@pytest.mark.vllm
@requires_vllm_env
def test_stop_ends_the_whole_process_group(server):
    pgid = server.proc.pid
    server.stop()
    assert live_group_members(pgid) == []
    assert not server.log_path.exists()  # a clean run leaves no temp log behind
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2.0)
    server.stop()  # idempotent


def test_the_default_log_is_a_new_private_file_not_a_name_another_user_could_plant(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """The log was $TMPDIR/alignflow-vllm-<port>.log, opened with truncation: a symlink another user planted there
    emptied its target (the port is predictable). It is now created exclusively, under a random name, mode 0600."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    server = VLLMServer(tiny_model_dir, python=sys.executable, startup_timeout=60)
    (tmp_path / f"alignflow-vllm-{server.port}.log").symlink_to(victim)
    with pytest.raises(VLLMServerError) as exc:
        server.start()  # the project venv has no vLLM: the server exits at once, and its log is kept
    assert victim.read_text() == "precious"
    assert server.log_path.parent == tmp_path and server.log_path.name.startswith(f"alignflow-vllm-{server.port}-")
    assert stat.S_IMODE(server.log_path.stat().st_mode) == 0o600
    assert str(exc.value).endswith(f"(log: {server.log_path})")
    assert "No module named 'vllm'" in server.log_path.read_text()


def test_start_failure_is_one_line_with_the_log_tail(tiny_model_dir, tmp_path):
    # the project venv has no vLLM: the server process dies at once with an import error
    server = VLLMServer(tiny_model_dir, python=sys.executable, log_path=tmp_path / "vllm.log", startup_timeout=60)
    with pytest.raises(VLLMServerError, match=r"exited with code 1 during start-up: .*No module named 'vllm'") as exc:
        server.start()
    assert "\n" not in str(exc.value) and server.proc is None


FAKE_SERVER = """import http.server, socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
time.sleep(1)  # vLLM binds its port only after loading the model
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()  # OSError: Address already in use
"""


def _fake_vllm_python(tmp_path):
    """An executable taking vLLM's command line whose server answers /health with 200 once it has bound its port."""
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    python.chmod(0o755)
    return python


def test_a_server_answering_on_the_port_is_not_taken_for_the_one_started(tiny_model_dir, tmp_path, answering_server):
    """The port is free when picked and bound by vLLM seconds later: another server taking it in between answered
    /health first and was taken for ours (a helper), whose process then died 'address in use' while sampling went to
    the other one. Healthy now means our process listens on the port too."""
    python = _fake_vllm_python(tmp_path)
    alone = VLLMServer(tiny_model_dir, python=python, log_path=tmp_path / "alone.log", startup_timeout=30).start()
    try:
        assert httpx.get(f"{alone.url}/health").status_code == 200
    finally:
        alone.stop()
    server = VLLMServer(tiny_model_dir, python=python, port=answering_server(200), log_path=tmp_path / "vllm.log",
                        startup_timeout=30)
    with pytest.raises(VLLMServerError, match=r"exited with code 1 during start-up: .*Address already in use"):
        server.start()


def test_missing_env_and_bad_model_dir_are_one_line_errors(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(VLLMServerError, match=r"no vLLM environment: .*/nope/python is not a file; .*make vllm-env"):
        VLLMServer(tiny_model_dir)
    with pytest.raises(ModelLoadError, match="no config.json"):
        VLLMServer(tmp_path, python=sys.executable)


def test_the_server_reads_safetensors_only(tiny_model_dir, tmp_path):
    """vLLM's default load format would read *.bin pickles: the dir is checked and the format pinned."""
    assert "--load-format safetensors" in " ".join(VLLMServer(tiny_model_dir, python=sys.executable).command())
    assert "--trust-remote-code" not in VLLMServer(tiny_model_dir, python=sys.executable).command()  # only when asked
    assert "--trust-remote-code" in VLLMServer(tiny_model_dir, python=sys.executable, trust_remote_code=True).command()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="only pickle weights"):
        VLLMServer(pickled, python=sys.executable)
