"""Profiles are rewritten byte-identically when their values did not change, and with a minimal
diff when one did (``lora-opt calibrate-e2e`` and ``lora-opt calibrate`` share one writer)."""
import difflib
import math
import os
import shutil

import pytest
import yaml

from lora_opt.calibration.e2e_fit import write_fitted_profile
from lora_opt.calibration.profile_io import header_of, profile_text, write_profile
from twin.paths import CONFIGS_DIR

PROFILES = sorted((CONFIGS_DIR / "profiles").glob("*.yaml"))


def _copy(tmp_path, src):
    dst = tmp_path / src.name
    shutil.copyfile(src, dst)
    os.utime(dst, ns=(1_000_000_000, 1_000_000_000))       # an old mtime: a rewrite would change it
    return dst


@pytest.mark.parametrize("src", PROFILES, ids=[p.stem for p in PROFILES])
def test_bundled_profiles_are_in_the_writers_style(src):
    text = src.read_text()
    assert profile_text(header_of(text), yaml.safe_load(text)) == text


@pytest.mark.parametrize("src", PROFILES, ids=[p.stem for p in PROFILES])
def test_same_values_leave_the_file_untouched(tmp_path, src):
    path = _copy(tmp_path, src)
    text = path.read_text()
    prof = yaml.safe_load(text)
    assert write_profile(path, header_of(text), prof) is False
    record = (prof.get("fit") or {}).get("e2e")
    if record is not None:          # calibrate-e2e's path: the same fitted values, another run's wall time
        rerun = dict(record, wall_s=record.get("wall_s", 0.0) + 17.0)
        assert write_fitted_profile(path, header_of(text), prof, rerun) is False
        # a replay's SMAPE differing in its last bits (the order of a sum) is no change either
        noisy = dict(record, search=[dict(row, loss=math.nextafter(row["loss"], math.inf))
                                     for row in record["search"]])
        assert write_fitted_profile(path, header_of(text), prof, noisy) is False
    assert path.read_bytes() == src.read_bytes() and path.stat().st_mtime_ns == 1_000_000_000


def _changed_lines(before: str, after: str) -> list[str]:
    return [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_one_changed_value_changes_only_its_lines(tmp_path):
    src = next(p for p in PROFILES if (yaml.safe_load(p.read_text()).get("fit") or {}).get("e2e"))
    path = _copy(tmp_path, src)
    before = path.read_text()
    prof = yaml.safe_load(before)
    record = dict(prof["fit"]["e2e"])
    record["params"] = dict(record["params"], slot_share=0.65)
    record["wall_s"] = record["wall_s"] + 5.0            # this run's own wall time
    rank = next(iter(prof["latency"]["lora"]))
    prof["latency"]["lora"][rank]["slot_share"] = 0.65
    assert write_fitted_profile(path, header_of(before), prof, record) is True
    changed = _changed_lines(before, path.read_text())
    # the latency.lora line, the fit.e2e.params line and the record's wall time: each once removed, once added
    assert len(changed) == 6, changed
    added = [line for line in changed if line.startswith("+")]
    assert sum("slot_share: 0.65" in line for line in added) == 2 and sum("wall_s:" in line for line in added) == 1
    assert yaml.safe_load(path.read_text())["fit"]["e2e"]["params"]["slot_share"] == 0.65
