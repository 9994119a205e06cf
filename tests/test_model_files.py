"""Loading a surrogate never runs code (hardening issue, item 1): pickle files, skops files holding
an untrusted type and tampered files are refused with InputError, and the harmless marker file the
crafted payloads would create is never created -- by the loader, by the policies' loader and by
``lora-opt place --surrogate DIR``."""
import hashlib
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from lora_opt.errors import InputError
from lora_opt.placement.policies.base import PlacementContext
from lora_opt.placement.workload_file import load_workload
from lora_opt.surrogates import model_files, training
from lora_opt.surrogates.features import FEATURES
from lora_opt.surrogates.oracle import Surrogate
from twin.paths import CONFIGS_DIR, REPO_ROOT

BUNDLED = CONFIGS_DIR / "surrogates" / "llama-3.1-8b-h100-64gb"
WORKLOAD = CONFIGS_DIR / "workloads" / "example.yaml"


class TouchOnUnpickle:
    """Unpickling this calls ``pathlib.Path(marker).touch()``: a stand-in for any code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return pathlib.Path(self.marker).touch, ()


def pickle_payload(marker) -> bytes:
    # pathlib.Path(marker).touch as a bound method: unpickling imports pathlib and calls it
    return pickle.dumps(TouchOnUnpickle(marker))


def skops_payload(marker) -> bytes:
    """A skops file whose "regressor" is ``builtins.exec(<touch the marker>)`` (skops calls a
    ConstructorFromReduceNode's type with its arguments), the "classifier" a plain string."""
    code = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"

    def json_node(value):
        return {"__class__": "str", "__module__": "builtins", "__loader__": "JsonNode",
                "content": json.dumps(value), "is_json": True, "__id__": id(value)}

    key = {"__class__": "str", "__module__": "builtins", "__loader__": "TypeNode", "__id__": 1}
    schema = {
        "__class__": "dict", "__module__": "builtins", "__loader__": "DictNode", "__id__": 2,
        "content": {
            "regressor": {"__class__": "exec", "__module__": "builtins", "__loader__": "ConstructorFromReduceNode",
                          "__id__": 3, "content": {"__class__": "tuple", "__module__": "builtins",
                                                   "__loader__": "TupleNode", "__id__": 4,
                                                   "content": [json_node(code)]}},
            "classifier": json_node("x"),
        },
        "key_types": {"__class__": "list", "__module__": "builtins", "__loader__": "ListNode", "__id__": 5,
                      "content": [key, key]},
        "protocol": 2, "_skops_version": "0.16.0",
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("schema.json", json.dumps(schema))
    return buf.getvalue()


def crafted_dir(tmp_path, kind: str, marker) -> pathlib.Path:
    """A surrogate directory an attacker could hand over: ``pickle`` (an old-style surrogate.joblib),
    ``skops`` (a valid manifest whose hash matches a skops file holding exec) or ``pickle-as-skops``."""
    d = tmp_path / f"crafted-{kind}"
    d.mkdir()
    shutil.copy(BUNDLED / "distilled.json", d / "distilled.json")
    if kind == "pickle":
        (d / "surrogate.joblib").write_bytes(pickle_payload(marker))
        return d
    blob = skops_payload(marker) if kind == "skops" else pickle_payload(marker)
    (d / model_files.MODEL_NAME).write_bytes(blob)
    manifest = json.loads((BUNDLED / model_files.MANIFEST_NAME).read_text())
    manifest["sha256"] = hashlib.sha256(blob).hexdigest()         # the hash is right: only trust stops it
    (d / model_files.MANIFEST_NAME).write_text(json.dumps(manifest))
    return d


def test_the_payloads_are_real(tmp_path):
    """Without the checks, each crafted file does create the marker (so the tests below have teeth)."""
    import skops.io as sio

    import joblib

    m1, m2, m3 = tmp_path / "m1", tmp_path / "m2", tmp_path / "m3"
    pickle.loads(pickle_payload(m1))
    assert m1.exists()
    (tmp_path / "surrogate.joblib").write_bytes(pickle_payload(m3))
    joblib.load(tmp_path / "surrogate.joblib")                  # what Surrogate.load used to do
    assert m3.exists()
    sio.loads(skops_payload(m2), trusted=["builtins.exec"])
    assert m2.exists()


@pytest.mark.parametrize("kind", ["pickle", "skops", "pickle-as-skops"])
def test_crafted_surrogate_is_refused_and_runs_nothing(tmp_path, kind):
    marker = tmp_path / "marker"
    d = crafted_dir(tmp_path, kind, marker)
    expected = {"pickle": "pickle", "skops": "builtins.exec", "pickle-as-skops": "not a readable skops"}[kind]
    for path in (d, d / model_files.MANIFEST_NAME, d / "surrogate.joblib"):
        if path.exists():
            with pytest.raises(InputError, match=expected) as exc:
                Surrogate.load(path)
            assert str(path.parent if path.is_file() else path) in str(exc.value)
    ctx = PlacementContext.for_workload(load_workload(WORKLOAD), d)
    with pytest.raises(InputError, match=expected):
        ctx.oracle("full")
    assert not marker.exists()


def test_pickle_files_are_refused_by_name(tmp_path):
    marker = tmp_path / "marker"
    for name in ("model.pkl", "surrogate.joblib", "x.pickle"):
        (tmp_path / name).write_bytes(pickle_payload(marker))
        with pytest.raises(InputError, match=rf"{name}: a pickle .*surrogate\.json"):
            Surrogate.load(tmp_path / name)
    assert not marker.exists()


def test_tampered_model_is_refused(tmp_path):
    d = tmp_path / "s"
    shutil.copytree(BUNDLED, d)
    Surrogate.load(d)                                            # intact: loads
    blob = bytearray((d / model_files.MODEL_NAME).read_bytes())
    blob[len(blob) // 2] ^= 0x01
    (d / model_files.MODEL_NAME).write_bytes(bytes(blob))
    with pytest.raises(InputError, match=r"surrogate\.skops: sha256 [0-9a-f]{64} does not match"):
        Surrogate.load(d)


@pytest.mark.parametrize("change, message", [
    ({"format": "lora-opt-surrogate/1"}, "format 'lora-opt-surrogate/1', expected 'lora-opt-surrogate/2'"),
    ({"model_file": "../surrogate.joblib"}, "model_file '../surrogate.joblib', expected 'surrogate.skops'"),
    ({"sha256": "abc"}, "sha256 must be 64"),
    ({"threshold": "high"}, "numeric threshold"),
])
def test_bad_manifest_is_refused(tmp_path, change, message):
    d = tmp_path / "s"
    shutil.copytree(BUNDLED, d)
    m = json.loads((d / model_files.MANIFEST_NAME).read_text())
    (d / model_files.MANIFEST_NAME).write_text(json.dumps({**m, **change}))
    with pytest.raises(InputError, match=message):
        Surrogate.load(d)


def test_missing_or_unreadable_files_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        Surrogate.load(tmp_path)
    (tmp_path / model_files.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(InputError, match="cannot read the surrogate manifest"):
        Surrogate.load(tmp_path)
    with pytest.raises(InputError, match="not a surrogate manifest"):
        Surrogate.load(BUNDLED / "metrics.json")


@pytest.mark.parametrize("kind", ["pickle", "skops"])
def test_place_cli_refuses_crafted_surrogate(tmp_path, kind):
    marker = tmp_path / "marker"
    d = crafted_dir(tmp_path, kind, marker)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "place", "--workload", str(WORKLOAD), "--gpus", "4",
                        "--surrogate", str(d), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora-opt place: error: "), r.stderr
    assert "Traceback" not in r.stderr and str(d) in lines[0]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_every_family_saves_and_loads_with_the_fixed_trusted_list(tmp_path):
    """What training can choose (each family, both k-NN metrics, kd- and ball-trees) round-trips
    through the trusted list bit for bit: TRUSTED_TYPES is complete for our models."""
    rng = np.random.default_rng(0)
    X = rng.random((120, len(FEATURES))) * 10
    y, c = X[:, 0] * 50 + 1, (X[:, 1] > 5).astype(int)
    for fam in training.FAMILIES:
        variants = [{}]
        if fam == "knn":
            variants = [{"model__p": p, "model__algorithm": a} for p in (1, 2) for a in ("kd_tree", "ball_tree")]
        for v in variants:
            reg = training.make_regressor(fam).set_params(**{f"regressor__{k}": x for k, x in v.items()}).fit(X, y)
            clf = training.make_classifier(fam).set_params(**v).fit(X, c)
            sur = Surrogate(reg, clf, 0.5)
            out = tmp_path / f"{fam}-{len(list(tmp_path.iterdir()))}"
            back = Surrogate.load(sur.save(out))
            for a, b in zip(sur.predict(X), back.predict(X)):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["pickle", "skops"])
def test_models_read_back_from_mlflow_go_through_the_fixed_list(tmp_path, kind):
    """An MLflow model directory (as a run's artifact) holding a pickle, or a skops file with an
    untrusted type, is refused by model_files.load_logged_model, whatever its MLmodel file trusts."""
    marker = tmp_path / "marker"
    d = tmp_path / "logged"
    d.mkdir()
    (d / "MLmodel").write_text("flavors:\n  sklearn:\n    serialization_format: skops\n"
                               "    skops_trusted_types: [builtins.exec]\n")
    if kind == "pickle":
        (d / "model.pkl").write_bytes(pickle_payload(marker))
    else:
        (d / "model.skops").write_bytes(skops_payload(marker))
    with pytest.raises(InputError, match="pickle" if kind == "pickle" else "builtins.exec"):
        model_files.load_logged_model(str(d))
    assert not marker.exists()


def _small_surrogate(seed: int) -> Surrogate:
    rng = np.random.default_rng(seed)
    X = rng.random((60, len(FEATURES))) * 10
    reg = training.make_regressor("knn").fit(X, X[:, 0] * 50 + seed)
    clf = training.make_classifier("knn").fit(X, (X[:, 1] > 5).astype(int))
    return Surrogate(reg, clf, 0.5)


def _same_model(a: Surrogate, b: Surrogate) -> bool:
    X = np.random.default_rng(9).random((20, len(FEATURES))) * 10
    return all(np.array_equal(x, y) for x, y in zip(a.predict(X), b.predict(X)))


def test_a_crash_while_writing_a_model_leaves_a_whole_one(tmp_path, monkeypatch):
    """The model and its manifest are two files with one commit point (the manifest): a write that
    dies before it leaves the previous model loading as before; one that dies after it (before the
    final rename) loads the new one; no state in between is refused as tampered."""
    old, new = _small_surrogate(0), _small_surrogate(1)
    d = tmp_path / "s"
    old.save(d)

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_files, "atomic_write_text", crash)     # dies writing the manifest
    with pytest.raises(OSError):
        new.save(d)
    monkeypatch.undo()
    assert _same_model(Surrogate.load(d), old) and not _same_model(old, new)

    real_replace = os.replace

    def crash_on_the_final_rename(src, dst):
        if pathlib.Path(src).name == model_files.PENDING_NAME:
            crash()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_final_rename)    # dies after the manifest
    with pytest.raises(OSError):
        new.save(d)
    monkeypatch.undo()
    assert (d / model_files.PENDING_NAME).is_file()
    assert _same_model(Surrogate.load(d), new)

    new.save(d)                                                       # a whole write tidies up
    assert not (d / model_files.PENDING_NAME).exists() and _same_model(Surrogate.load(d), new)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []   # no temporaries left
