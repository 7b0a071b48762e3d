"""The doctor against two real vLLM engines of their own, configured as a fleet should not be:
one without prefix caching, one caching blocks of another size. Apart from the session's pair
(tests/real_fleet.py), so that these engines start on another worker while the pair's tests run.
"""

from __future__ import annotations

import pytest

from engines.fleet import VLLMFleet, model_folder
from engines.replica import VLLMReplica
from engines.tiny_model import ensure_model
from engines.venv import VLLMVenv
from tests.real_fleet import BLOCK, MODEL
from tests.test_doctor import by_check, doctor

pytestmark = pytest.mark.real_vllm


def test_doctor_on_engines_without_prefix_caching_or_with_other_blocks() -> None:
    """Two more engines, started together: one with prefix caching off, one caching blocks
    of 64 tokens; the doctor routes as for the fleet's blocks of 32."""
    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    names = (MODEL,)
    engines = [
        VLLMReplica(
            model,
            venv=venv,
            served_model_names=names,
            cpu_cores="0",
            extra_args=("--no-enable-prefix-caching",),
        ),
        VLLMReplica(model, venv=venv, served_model_names=names, cpu_cores="1", block_size=64),
    ]
    flags = ("--tokenizer", str(model_folder()), "--engine-block-size", str(BLOCK))
    with VLLMFleet(engines) as started:
        off, other_blocks = started.replicas
        status, rows = doctor("--backend", off.url, "--backend", other_blocks.url, *flags)
    assert status == 1
    without = by_check(rows, off.address)
    assert without["prefix-caching"][0] == "FAIL"
    assert "--enable-prefix-caching" in without["prefix-caching"][1]
    assert without["cached-tokens-reported"][0] == "PASS"
    assert without["token-agreement"] == (
        "FAIL",
        "nothing was served from cache to compare (see prefix-caching)",
    )
    blocks = by_check(rows, other_blocks.address)
    assert blocks["prefix-caching"][0] == "PASS"
    verdict, detail = blocks["token-agreement"]
    assert verdict == "FAIL"
    assert "as blocks of 64 tokens would; the gateway hashes blocks of 32" in detail, detail
