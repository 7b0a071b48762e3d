"""Two real vLLM replicas on this machine's cores with the gateway in front: `make run-real`.

    python -m engines.fleet [--port 8080] [--replicas 2] [-- GATEWAY ARGS...]

installs vLLM's CPU build if needed (engines.venv), makes the tiny model if needed
(engines.tiny_model), starts the replicas pinned to different cores, then
`python -m prefix_gateway serve --port 8080 --backend URL1 --backend URL2` (with the model's
tokenizer and the engines' block size) from the checkout's .venv, prints where to send requests,
and stops everything on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

from engines.replica import MIB, VLLMReplica, answers_ok
from engines.tiny_model import ensure_model
from engines.venv import ROOT, VLLMVenv

MODEL_NAME = "tiny-llama"


def model_folder() -> Path:
    return ROOT / ".engines" / "models" / MODEL_NAME


class VLLMFleet:
    """Replicas started together (each waits for its own health) and stopped together."""

    def __init__(self, replicas: Sequence[VLLMReplica]) -> None:
        self.replicas = list(replicas)

    @classmethod
    def pinned(
        cls,
        model: Path,
        count: int = 2,
        *,
        venv: VLLMVenv | None = None,
        served_model_names: Sequence[str] = (MODEL_NAME,),
        block_size: int = 32,
        kv_cache_bytes: int = 16 * MIB,
        extra_args: Sequence[str] = (),
        log_folder: Path | None = None,
    ) -> VLLMFleet:
        """`count` replicas of one model, replica i pinned to core i modulo the cores here."""
        cores = os.cpu_count() or 1
        return cls(
            [
                VLLMReplica(
                    model,
                    venv=venv,
                    served_model_names=served_model_names,
                    block_size=block_size,
                    kv_cache_bytes=kv_cache_bytes,
                    cpu_cores=str(i % cores),
                    extra_args=extra_args,
                    log_path=None if log_folder is None else log_folder / f"replica-{i}.log",
                )
                for i in range(count)
            ]
        )

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def start(self) -> Self:
        """Spawn every replica from this thread, then wait for each; stop all if one fails."""
        try:
            for replica in self.replicas:
                replica.spawn()
            for replica in self.replicas:
                replica.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for replica in self.replicas:
            replica.__exit__(kind, error, trace)


class Stopped(Exception):
    """SIGTERM arrived: unwind as Ctrl-C does."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Stopped


def _gateway_python() -> str:
    local = ROOT / ".venv" / "bin" / "python"
    return str(local) if local.is_file() else sys.executable


def _wait_gateway(process: subprocess.Popen[bytes], url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with status {process.returncode}")
        if answers_ok(url + "/health"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not answer {url}/health within {seconds:.0f} s")


def _stop(process: subprocess.Popen[bytes], seconds: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def gateway_flags(options: argparse.Namespace, urls: Sequence[str], model: Path) -> list[str]:
    """`serve`'s flags in front of the replicas at `urls`: routing on the engines' own tokens
    and blocks (the model's tokenizer and chat template, their block size), then the flags
    given after `--`, which may override any of these."""
    return [
        "--host",
        options.host,
        "--port",
        str(options.port),
        *(part for url in urls for part in ("--backend", url)),
        "--tokenizer",
        str(model),
        "--engine-block-size",
        str(options.block_size),
        *options.gateway_args,
    ]


def parse_options(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="real vLLM replicas behind the gateway")
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    parser.add_argument("--port", type=int, default=8080, help="the gateway's port")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=16)
    parser.add_argument("--model-name", default=MODEL_NAME, help="--served-model-name")
    parser.add_argument("gateway_args", nargs="*", help="more `gateway serve` flags, after --")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_options(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)

    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    logs = ROOT / ".engines" / "logs"
    print(f"[engines] starting {options.replicas} vLLM replicas (about a minute)...", flush=True)
    started = time.monotonic()
    gateway: subprocess.Popen[bytes] | None = None
    try:
        with VLLMFleet.pinned(
            model,
            options.replicas,
            venv=venv,
            served_model_names=(options.model_name,),
            block_size=options.block_size,
            kv_cache_bytes=options.kv_cache_mib * MIB,
            log_folder=logs,
        ) as fleet:
            print(
                f"[engines] replicas healthy after {time.monotonic() - started:.0f} s: "
                + " ".join(fleet.urls),
                flush=True,
            )
            command = [
                _gateway_python(),
                "-m",
                "prefix_gateway",
                "serve",
                *gateway_flags(options, fleet.urls, model),
            ]
            gateway = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL)
            url = f"http://{options.host}:{options.port}"
            _wait_gateway(gateway, url, 60)
            print(_banner(url, options.model_name, fleet.urls, logs), flush=True)
            while gateway.poll() is None:
                time.sleep(0.5)
            print(f"[engines] the gateway exited with status {gateway.returncode}", flush=True)
            return gateway.returncode or 1
    except (KeyboardInterrupt, Stopped):
        print("\n[engines] stopping...", flush=True)
        return 0
    finally:
        if gateway is not None:
            _stop(gateway)


def _banner(url: str, model: str, replicas: Sequence[str], logs: Path) -> str:
    return f"""
The gateway listens on {url}, in front of {len(replicas)} vLLM replicas:
  {chr(10).join("  " + r for r in replicas).lstrip()}
(replica logs in {logs}). Try:

  curl -s {url}/v1/chat/completions -H 'content-type: application/json' -i \\
    -d '{{"model": "{model}", "max_tokens": 16, "ignore_eos": true,
         "messages": [{{"role": "user", "content": "hello"}}]}}'

The model is tiny and random: its words are noise; the x-gateway-backend header and
usage.prompt_tokens_details.cached_tokens are the point. Ctrl-C stops everything.
"""


if __name__ == "__main__":
    sys.exit(main())
