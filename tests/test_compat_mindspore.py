"""`msprobe_engine.compat.mindspore`: the predecessor's MindSpore API (PyNative) with one import line changed.

Its documented dump usage (tests/fixtures/predecessor_examples/mindspore_dump.py: start(net),
stop(), step() around each step, no gradients passed) runs in child processes twice: as written
against the real predecessor (mindstudio-probe 26.2, MindSpore 2.10 on CPU) and with only
``from msprobe.mindspore import`` replaced; both write the same steps, entries and records,
parameter gradients included, and the same losses.
The predecessor's statistics call `mint.norm`, whose kernel is not registered on MindSpore's
CPU backend: its side runs with ``norm`` as ``sqrt(sum(x * x))`` (a prelude, not the example).
"""
from __future__ import annotations

import pytest

from msprobe_engine.errors import ConfigError
from tests.compat_helpers import CPU_NORM, MINDSPORE_IMPORTS, run_example, same_records, step_documents

pytestmark = pytest.mark.slow

#: what the predecessor dumps at L1 and we leave out (metadata calls: `capture.apis.METADATA_PRIMITIVES`)
THEIRS_ONLY = ("Primitive.shape_op.Shape.", "Functional.shape.")


def _run(tmp_path, level: str, ours: bool):
    config = {"task": "statistics", "level": level, "rank": [], "step": [],
              "statistics": {"scope": [], "list": [], "data_mode": ["all"]}}
    path, out = run_example("mindspore_dump.py", tmp_path, ours, config, imports=MINDSPORE_IMPORTS,
                            their_prelude="" if ours else CPU_NORM)
    return step_documents(path), [line for line in out.splitlines() if line.startswith("loss ")]


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_mindspore_example_writes_what_the_predecessor_writes(tmp_path, level):
    theirs, their_losses = _run(tmp_path, level, ours=False)
    ours, our_losses = _run(tmp_path, level, ours=True)
    assert our_losses == their_losses and len(their_losses) == 2
    assert list(ours) == list(theirs) == ["step0", "step1"]
    for step, document in theirs.items():
        assert {k: v for k, v in ours[step].items() if k != "data"} == {k: v for k, v in document.items()
                                                                       if k != "data"}
        compared = [entry for entry in document["data"] if not entry.startswith(THEIRS_ONLY)]
        missing = [entry for entry in compared if entry not in ours[step]["data"]]
        assert not missing, f"{step}: entries of the predecessor missing from ours: {missing}"
        if level == "L0":  # the Cells, their backward and the parameter gradients, nothing else; ours
            # lists the parameter gradients after the calls (they come with step()), the predecessor as they arrive
            assert sorted(ours[step]["data"]) == sorted(compared)
            calls = [entry for entry in compared if ".parameters_grad." not in entry]
            assert [entry for entry in ours[step]["data"] if ".parameters_grad." not in entry] == calls
            assert len(calls) < len(compared)
        for entry in compared:
            if entry.endswith(".backward") and level == "L1":  # ours also records the gradient of the
                continue  # data entering the first Dense (test_mindspore_predecessor's OURS_ONLY)
            same_records(ours[step]["data"][entry], _without_empty_parameters(document["data"][entry]), f"{step}/{entry}")


def _without_empty_parameters(record: dict) -> dict:
    """The predecessor writes ``"parameters": {}`` for a Cell without parameters; ours leaves it out."""
    return {k: v for k, v in record.items() if not (k == "parameters" and v == {})}


def test_what_is_not_provided_names_what_to_use():
    with pytest.raises(ImportError, match="TrainerMon.*msprobe_integrations.mindspore"):
        from msprobe_engine.compat.mindspore import TrainerMon  # noqa: F401


def test_seed_all_checks_its_arguments():
    from msprobe_engine.compat.mindspore import seed_all

    with pytest.raises(ConfigError, match="seed"):
        seed_all(seed=-1)
    with pytest.raises(ConfigError, match="rm_dropout"):
        seed_all(rm_dropout=True)
