"""Round trips with the real predecessor on models we did not write (`pairing_models`): an MHA
self-attention LM (``attn(h, h, h)``), transformers' ResNet (BatchNorm), Mixtral (MoE) and T5
(encoder-decoder). One training step of each, at mix, dumped by its PrecisionDebugger and by
ours (each in a process of its own): the same entry names; its ``msprobe compare`` pairs every
row; our ``compare`` pairs every entry both ways; rows judged error are only the ones listed
in `EXPLAINED`, each for a reason the predecessor's own numbers or hooks give.
"""
from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from msprobe_engine.analysis import compare_dumps
from predecessor_helpers import TESTS, _env, run_msprobe

pytestmark = pytest.mark.slow
MODELS = ("mha_lm", "resnet", "mixtral", "t5")
#: (entry, tensor) rows that differ for a known reason, by model
EXPLAINED = {
    # attn(h, h, h): its hooks hand the module three tensors, so attention projects q, k and v
    # apart and each position gets its own gradient; ours gets the whole gradient in position 0
    "mha_lm": {(f"Module.layers.{i}.attn.MultiheadAttention.backward.0", "output.0") for i in (0, 1)},
    # ResNetModel's last_hidden_state is read only by its own pooler: torch's full backward hook
    # gives it no gradient, ours gives the one from that read (docs/dump.md, differences)
    "resnet": {("Module.resnet.ResNetModel.backward.0", "input.0")},
    # the router's one-hot index buffer is torch.empty memory before __setitem__ writes it
    "mixtral": {("Tensor.__setitem__.0.forward", "input_args.0")},
    # where(mask, x, finfo.min): its float32 Mean/Norm overflow to -inf/inf, our float64 ones do not
    "t5": set(),
}
#: a row of its compare table: ``<entry>.<tensor>`` (``Module.a.B.backward.0.input.0``, ``Torch.where.2.forward.output.0``)
ROW = re.compile(r"^(Module\..+?\.(?:forward|backward)\.\d+|.+?\.\d+\.(?:forward|backward))\.(.+)$")
#: T5's masks: every Torch.where whose output holds float32's lowest value
OVERFLOWING = ("Torch.where.", "output.0")


def _dumps(root: Path, model: str) -> dict[str, Path]:
    children = {tool: subprocess.Popen([sys.executable, str(TESTS / "pairing_run.py"), tool, model,
                                        str(root / tool), "mix"], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env=_env())
                for tool in ("theirs", "ours")}
    for tool, child in children.items():
        out, _ = child.communicate(timeout=600)
        assert child.returncode == 0, f"{tool} on {model}:\n{out[-3000:]}"
    return {tool: root / tool / "step0" for tool in children}


def _entries(step_dir: Path) -> dict:
    (path,) = step_dir.glob("*/dump.json")
    return json.loads(path.read_text())["data"]


def _explained(model: str, entry: str, tensor: str) -> bool:
    if (entry, tensor) in EXPLAINED[model]:
        return True
    return model == "t5" and entry.startswith(OVERFLOWING[0]) and tensor == OVERFLOWING[1]


@pytest.mark.parametrize("model", MODELS)
def test_both_compares_pair_every_entry_on_models_we_did_not_write(tmp_path, model):
    dumps = _dumps(tmp_path, model)
    theirs, ours = _entries(dumps["theirs"]), _entries(dumps["ours"])
    assert sorted(ours) == sorted(theirs)

    out = tmp_path / "their_compare"
    out.mkdir()
    run_msprobe("compare", "-tp", str(dumps["ours"]), "-gp", str(dumps["theirs"]), "-o", str(out))
    (table,) = glob.glob(str(out / "compare_result_*"))
    rows = pd.read_excel(table) if table.endswith(".xlsx") else pd.read_csv(table)
    assert len(rows) > 100
    assert not (rows["NPU Name"].astype(str) == "N/A").any() and not (rows["Bench Name"].astype(str) == "N/A").any()
    for name in rows[rows["Result"] == "error"]["NPU Name"]:
        found = ROW.match(name)
        assert found is not None and _explained(model, found[1], found[2]), name

    for a, b in ((dumps["theirs"], dumps["ours"]), (dumps["ours"], dumps["theirs"])):
        comp = compare_dumps(a, b)
        (rank,) = comp.ranks
        assert not rank.only_a and not rank.only_b and not rank.order_fallback
        assert rank.matched_by["name"] == len(theirs)
        errors = [r for r in comp.rows if r["status"] == "error"]
        assert all(_explained(model, r["entry_a"], r["tensor"]) for r in errors), errors[:3]
