"""The real-vLLM test tier: fixtures that start real vLLM servers (the CPU build, 0.32) on loopback.

Every test in this folder is marked ``real_vllm``.  The tier is built by ``bash tools/vllm_tier/build.sh``
(its own venv, a tiny model with a locally trained tokenizer, adapters of ranks 8/16/32); where it is
missing the tests skip with a message saying how to build it -- except under CI (``CI`` set), where a
missing tier is an error: CI builds it and these tests must run there.

Servers are started with the product's own launcher (:class:`lora_opt.probe.launch.LaunchedServer`:
a process group of its own, bounded wait on ``/health``, stopped by signalling the group), bound to
127.0.0.1 on a free port, and always stopped at the fixture's end.  Plain helpers (the tier's manifest,
``tier_command``, ``tier_env``, ``free_port``) are in ``real_vllm_tier.py``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from real_vllm_tier import (
    BUILD_HINT,
    HEALTH_TIMEOUT_S,
    load_tier,
    tier_command,
    tier_dir,
)

from lora_opt.probe.launch import LaunchedServer, ServeCommand


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_vllm)


@pytest.fixture(scope="session")
def tier() -> dict:
    t = load_tier()
    if t is None:
        if os.environ.get("CI"):
            pytest.fail(f"the real-vLLM tier is not built at {tier_dir()} and CI must run these tests: {BUILD_HINT}")
        pytest.skip(f"real vLLM tier not built at {tier_dir()}: {BUILD_HINT}")
    return t


@pytest.fixture(scope="session")
def launch_vllm(tier, tmp_path_factory):
    """A factory: ``launch_vllm(cmd) -> LaunchedServer`` (healthy), stopped at the session's end at the
    latest (call ``.stop()`` sooner to free the cores)."""
    started: list[LaunchedServer] = []
    logs = tmp_path_factory.mktemp("vllm-logs")

    def launch(cmd: ServeCommand, *, expect_start: bool = True) -> LaunchedServer:
        server = LaunchedServer(cmd, server_cmd=None, log_path=logs / f"vllm-{cmd.port}.log",
                                health_timeout_s=HEALTH_TIMEOUT_S)
        started.append(server)
        ok = server.start()
        if expect_start and not ok:
            pytest.fail(f"real vLLM did not start (exit {server.exit_code}): {server.log_tail(15)}")
        return server

    yield launch
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def vllm_server(tier, launch_vllm) -> LaunchedServer:
    """The shared real vLLM of the tier: every adapter of the tier (2 per rank 8/16/32) served,
    ``--max-loras 2 --max-lora-rank 32 --max-cpu-loras 4 --max-model-len 512 --max-num-seqs 16``.
    Tests must leave it as they found it (unload what they load at run time)."""
    return launch_vllm(tier_command(tier))
