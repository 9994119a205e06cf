"""Starting and stopping the server ``lora-opt probe --launch`` measures: a ``vllm serve`` command (as
``lora-opt place --emit-vllm`` writes it) re-flagged per measurement family (LoRA off, one
``max_lora_rank`` per launch, generated adapter names), started as a subprocess, waited for on
``/health``, stopped at the end.

``server_cmd`` replaces ``vllm serve MODEL`` with another command that takes vLLM's flags -- in tests
and in the runbook's dry run, ``lora-opt emulate --profile P --speed S``: the flags the emulator has
no analogue for (it always behaves as they pin) are dropped for it (:data:`EMULATOR_IMPLIED_FLAGS`).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lora_opt.errors import InputError
from lora_opt.placement.vllm_launch import PINNED_SWITCHES

#: vLLM flags without a value that the emulator implies (no prefix caching, no async scheduling: every
#: release's spelling of the switches launch commands pin) or does not need (LoRA is on when
#: --lora-modules is given)
EMULATOR_IMPLIED_FLAGS = ("--enable-lora", *(s for spellings in PINNED_SWITCHES for s in spellings))
#: vLLM flags with one value that the emulator implies (block size 16, FCFS)
EMULATOR_IMPLIED_OPTIONS = ("--block-size", "--scheduling-policy")
#: the flags a LoRA-off launch drops
LORA_OPTIONS = ("--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules")
#: wall seconds to wait for /health (vLLM loads weights and captures CUDA graphs: minutes)
HEALTH_TIMEOUT_S = 900.0
#: wall seconds between SIGTERM and SIGKILL at stop
STOP_GRACE_S = 30.0


@dataclass
class ServeCommand:
    """A ``vllm serve`` command taken apart: environment, model, options (flag -> list of values)."""

    env: dict[str, str]
    model: str
    options: dict[str, list[str]] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return (self.options.get("--host") or ["127.0.0.1"])[0]

    @property
    def port(self) -> int:
        return int((self.options.get("--port") or ["8000"])[0])

    def flag(self, name: str, default=None):
        v = self.options.get(name)
        return v[0] if v else default

    def with_options(self, drop=(), **values) -> "ServeCommand":
        """A copy without ``drop`` and with ``values`` (``max_lora_rank=16`` -> ``--max-lora-rank 16``;
        a list for several values, True for a flag without a value)."""
        opts = {k: list(v) for k, v in self.options.items() if k not in drop}
        for k, v in values.items():
            name = "--" + k.replace("_", "-")
            opts[name] = [] if v is True else [str(x) for x in v] if isinstance(v, (list, tuple)) else [str(v)]
        return ServeCommand(dict(self.env), self.model, opts)

    def argv(self, server_cmd: str | None = None) -> list[str]:
        """The argv to run: ``vllm serve MODEL ...``, or ``server_cmd ...`` with the flags the
        emulator implies dropped."""
        head = ["vllm", "serve", self.model] if not server_cmd else shlex.split(server_cmd)
        out = list(head)
        for name, values in self.options.items():
            if server_cmd and (name in EMULATOR_IMPLIED_FLAGS or name in EMULATOR_IMPLIED_OPTIONS):
                continue
            out += [name, *values]
        return out


def parse_serve_command(text: str) -> ServeCommand:
    """``[VAR=VALUE ...] [exec] [env] vllm serve MODEL [--flag [values...]] ...``."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise InputError(f"--launch: cannot parse the command: {exc}") from None
    env: dict[str, str] = {}
    while words and (words[0] in ("exec", "env") or ("=" in words[0] and not words[0].startswith("-"))):
        w = words.pop(0)
        if "=" in w:
            k, v = w.split("=", 1)
            env[k] = v
    if words[:2] != ["vllm", "serve"] or len(words) < 3 or words[2].startswith("-"):
        raise InputError("--launch: expected a 'vllm serve MODEL [options]' command (as lora-opt place "
                         f"--emit-vllm writes them), got {text[:120]!r}")
    options: dict[str, list[str]] = {}
    name = None
    for w in words[3:]:
        if w.startswith("--"):
            name, _, inline = w.partition("=")
            options[name] = [inline] if inline else []
        elif name is None:
            raise InputError(f"--launch: value {w!r} before any option")
        else:
            options[name].append(w)
    return ServeCommand(env, words[2], options)


def read_launch(spec: str, gpu_index: int = 0) -> ServeCommand:
    """The command of ``--launch``: a command line, a ``gpuN.sh`` script or ``serve_commands.txt``
    (line ``gpu_index``) as ``lora-opt place --emit-vllm`` writes them."""
    path = Path(spec)
    if path.is_file():
        lines = [ln.strip() for ln in path.read_text().splitlines()
                 if ln.strip() and not ln.lstrip().startswith(("#", "!"))]
        if path.suffix == ".sh":
            lines = [ln for ln in lines if "vllm serve" in ln]
        if not 0 <= gpu_index < len(lines):
            raise InputError(f"--launch {spec}: no command for GPU index {gpu_index} ({len(lines)} command(s))")
        return parse_serve_command(lines[gpu_index])
    return parse_serve_command(spec)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as r:   # noqa: S310 - the user's own server
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LaunchedServer:
    """One server started from a :class:`ServeCommand`: ``start()`` waits for ``/health`` (or the
    process's exit: a refused start-up, e.g. out of memory); ``stop()`` terminates its process group."""

    def __init__(self, cmd: ServeCommand, *, server_cmd: str | None, log_path: Path,
                 health_timeout_s: float = HEALTH_TIMEOUT_S):
        self.cmd, self.server_cmd, self.log_path = cmd, server_cmd, Path(log_path)
        self.health_timeout_s = health_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = f"http://{cmd.host}:{cmd.port}"
        self.startup_s = float("nan")
        self.exit_code: int | None = None

    def start(self) -> bool:
        """True once healthy; False when the process exited first (``exit_code``, the log says why)."""
        if _healthy(self.url):
            raise InputError(f"--launch: something already answers on {self.url}; stop it or use another --port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.cmd.argv(self.server_cmd)
        # VAR=VALUE prefixes as a shell reads them: $VAR / ${VAR} in a value is the caller's (PATH=/x:$PATH)
        env = {**os.environ, **{k: os.path.expandvars(v) for k, v in self.cmd.env.items()}}
        log = open(self.log_path, "wb")
        log.write(("$ " + shlex.join(argv) + "\n").encode())
        log.flush()
        t0 = time.perf_counter()
        try:
            # its own session: stop() signals the server and the workers it spawns, nothing else
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            log.close()
            raise InputError(f"--launch: cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        log.close()
        while time.perf_counter() - t0 < self.health_timeout_s:
            if self.proc.poll() is not None:
                self.exit_code = self.proc.returncode
                return False
            if _healthy(self.url):
                self.startup_s = time.perf_counter() - t0
                return True
            time.sleep(0.2)
        self.stop()
        raise InputError(f"--launch: {self.url}/health did not answer within {self.health_timeout_s:g} s "
                         f"(log: {self.log_path})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 3) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
