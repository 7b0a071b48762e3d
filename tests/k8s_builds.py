"""What an operator builds from k8s/: an overlay (the gateway and its engines), or an overlay of
their own that adds components to one, as docs/deploy.md describes. Such an overlay is written
into a copy of k8s/, at k8s/overlays/NAME, the place the docs tell the operator to put it."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from tests.kustomize_render import Manifest, render

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
OVERLAYS = sorted(path.parent for path in (K8S / "overlays").glob("*/kustomization.yaml"))
COMPONENTS = sorted(path.parent.name for path in (K8S / "components").glob("*/kustomization.yaml"))
COMBINATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm+monitoring": ("vllm", ("monitoring",)),
    "vllm+precise-routing": ("vllm", ("precise-routing",)),
    "vllm+api-keys": ("vllm", ("api-keys",)),
    "vllm+tenants": ("vllm", ("tenants",)),
    "vllm+all": ("vllm", ("monitoring", "precise-routing", "api-keys", "tenants")),
    "sglang+monitoring": ("sglang", ("monitoring",)),
    "sglang+api-keys": ("sglang", ("api-keys",)),
    "sglang+monitoring+api-keys": ("sglang", ("monitoring", "api-keys")),
}
"""Every documented combination: precise routing needs vLLM's events, so it has no SGLang one."""
BUILDS = [*(path.name for path in OVERLAYS), *COMBINATIONS]

_copies: list[Path] = []


def k8s_copy() -> Path:
    """A copy of k8s/ for this test process, made at the first call."""
    if not _copies:
        root = Path(tempfile.mkdtemp(prefix="k8s-builds-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        shutil.copytree(K8S, root / "k8s")
        _copies.append(root / "k8s")
    return _copies[0]


def operator_overlay(name: str, kustomization: str) -> Path:
    """`kustomization` written as k8s/overlays/NAME/kustomization.yaml in the copy."""
    directory = k8s_copy() / "overlays" / name
    directory.mkdir(exist_ok=True)
    (directory / "kustomization.yaml").write_text(kustomization)
    return directory


def combination_text(overlay: str, components: tuple[str, ...]) -> str:
    listed = "".join(f"  - ../../components/{component}\n" for component in components)
    return (
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        "namespace: llm\n"
        f"resources:\n  - ../{overlay}\n"
        f"components:\n{listed}"
    )


def engine_of(name: str) -> str:
    """The engine the build `name` routes to: its overlay's name."""
    return COMBINATIONS[name][0] if name in COMBINATIONS else name


def components_of(name: str) -> tuple[str, ...]:
    return COMBINATIONS[name][1] if name in COMBINATIONS else ()


def build_dir(name: str) -> Path:
    """Where the build `name` (an overlay or a combination) is: what kustomize is given."""
    if name in COMBINATIONS:
        return operator_overlay(name, combination_text(*COMBINATIONS[name]))
    return K8S / ("base" if name == "base" else f"overlays/{name}")


def built(name: str) -> list[Manifest]:
    return render(build_dir(name))
