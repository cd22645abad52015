"""How a command ends on a signal: Ctrl-C and SIGTERM also stop Prefect's temporary server, which shares the
command's process group, and Prefect's client then retried that dead server for minutes. Light on imports: the CLI
arms this before Prefect loads."""

from __future__ import annotations

import os
import signal
import sys
import threading

# seconds after a SIGTERM at which a flow run by the CLI exits (`exit_soon_after_sigterm`); None elsewhere (a
# deployment's run: its server is not this process group's)
SIGTERM_GRACE_S: float | None = None


def exit_after(grace_s: float, cause: str, code: int) -> None:
    """Exit the process with `code` `grace_s` from now, marking a pipeline's open MLflow run KILLED with `cause`
    first, whatever Prefect's client is still doing (retrying a server that has stopped)."""

    def leave() -> None:
        threading.Timer(5.0, os._exit, args=(code,)).start()  # whatever MLflow's store does
        tracking = sys.modules.get("pipeline_lib.tracking")  # imported iff an MLflow run may be open
        if tracking is not None:
            try:
                tracking.end_interrupted_pipeline_run(cause)
            except Exception:  # noqa: BLE001 - exiting anyway; the next run in the workspace ends it
                pass
        os._exit(code)

    deadline = threading.Timer(grace_s, leave)
    deadline.daemon = True
    deadline.start()


def exit_soon_after_sigterm() -> None:
    """In a flow the CLI runs, a SIGTERM also exits the process SIGTERM_GRACE_S later (code 143). Prefect's engine
    holds SIGTERM during a flow (it raises TerminationSignal and reports the run's end to its server); a SIGTERM
    to the command's process group (timeout, systemd, Slurm) has stopped that server too, the temporary one in
    this group, and the engine's client retried it for minutes, holding the workspace. So the engine's handler is
    chained, not replaced, in the main thread (the only one signals reach)."""
    if SIGTERM_GRACE_S is None or threading.current_thread() is not threading.main_thread():
        return
    engine = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame) -> None:
        exit_after(SIGTERM_GRACE_S, "SIGTERM", 143)
        if callable(engine):
            engine(signum, frame)
        else:
            os._exit(143)  # the default action, or an ignored signal a user meant to stop

    signal.signal(signal.SIGTERM, on_sigterm)


def exit_soon_after_ctrl_c(grace_s: float = 10.0) -> None:
    """Ctrl-C raises KeyboardInterrupt as usual, so the stage stops the way Python stops (its vLLM server, an
    atomic checkpoint write). But the terminal's SIGINT also stops Prefect's temporary server, which shares this
    process group, and Prefect's client then retries that dead server for minutes. So the process exits by
    itself `grace_s` after the first Ctrl-C, marking a pipeline's MLflow run KILLED first, and at once on a second
    (exit code 130); the next run in the workspace ends the Prefect runs (and any MLflow run) it left open. A
    SIGTERM to the group (timeout, systemd, Slurm) does the same to the server: the flows this process runs exit
    `grace_s` after it too (`exit_soon_after_sigterm`)."""

    def on_ctrl_c(signum, frame) -> None:
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
        exit_after(grace_s, "Ctrl-C", 130)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    global SIGTERM_GRACE_S
    SIGTERM_GRACE_S = grace_s
