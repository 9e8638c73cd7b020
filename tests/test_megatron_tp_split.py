"""Tensor parallel 2 on gloo: each replicated activation is measured by one TP rank only
(`megatron.tp_split`), and every record is the same, bit for bit, as when every rank measures
every activation."""
from __future__ import annotations

import pytest

from tests.multiproc import run_ranks
from tests.sink_helpers import untimed

pytestmark = pytest.mark.slow
STEPS = 3
WATCH = {"module_outputs": True, "activation_grads": True, "param_grads": True, "params": False,
         "optimizer_state": ["exp_avg"]}


def _train(rank: int, world: int, out: str) -> dict:
    from msprobe_integrations.megatron import MegatronMonitor
    from msprobe_integrations.megatron.tp_split import ReplicaSplit
    from tests import megatron_helpers as H

    H.init_parallel(tp=2)
    runs, owned = {}, {}
    for split in (True, False):
        model = H.wrap_ddp(H.build_gpt())
        optimizer = H.build_optimizer([model])
        install = ReplicaSplit.install
        if not split:
            ReplicaSplit.install = lambda self: None  # every rank measures every activation
        try:
            monitor = MegatronMonitor([model], optimizer, config={"output_dir": f"{out}/{split}", "strict": True,
                                                                   "sinks": [], "watch": WATCH})
        finally:
            ReplicaSplit.install = install
        records = []
        for step in range(STEPS):
            loss, _, _ = H.train_step(model, optimizer, H.micro_batches(H.TinySpec(), 2, seed=step))
            records.append(untimed(monitor.step_end(loss).metrics))
        reducer = monitor.monitor.reducer
        if split:
            owned = {"elsewhere": sorted("/".join(k) for k in reducer.elsewhere)}
        monitor.close()
        runs[split] = records
    return {"split": runs[True], "whole": runs[False], **owned}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_train, 2, str(tmp_path_factory.mktemp("tp_split")), timeout=300)


def test_records_are_bitwise_those_of_every_rank_measuring_everything(ranks):
    for rank in ranks:
        assert rank["split"] == rank["whole"]  # every tag, every step: the same floats
        assert any("actv_grad/" in tag for tag in rank["split"][-1])


def test_each_replicated_activation_is_measured_by_one_rank(ranks):
    first, second = (set(rank["elsewhere"]) for rank in ranks)
    assert first and second and not first & second  # left to the other rank: disjoint, both sides
    replicated = first | second
    assert any(k.startswith("actv/decoder.layers.0.input_layernorm/") for k in replicated)
    assert any(k.startswith("actv_grad/") for k in replicated)
    assert not any("linear_qkv" in k or "linear_fc1" in k for k in replicated)  # column-parallel: partitioned
