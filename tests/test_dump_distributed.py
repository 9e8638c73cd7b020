"""Two gloo ranks: rank directories, Distributed.* entries, rank selection and rank validation."""
from __future__ import annotations

from multiproc import run_ranks
from msprobe_engine.dump import load_dump


def _rank_main(rank: int, world: int, root: str) -> str:
    import torch
    import torch.distributed as dist

    from msprobe_engine.config import ConfigError
    from msprobe_engine.dump import PrecisionDebugger

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, ranks in (("all", []), ("only1", [1])):
            with PrecisionDebugger({"dump_path": f"{root}/{name}", "level": "L1", "rank": ranks,
                                    "strict": True}) as debugger:
                with debugger.step_scope():
                    x = torch.full((4,), float(rank + 1))
                    dist.all_reduce(x)
                    torch.relu(x)
        try:
            PrecisionDebugger({"dump_path": f"{root}/bad", "rank": [0, "1-2"]}).start()
        except ConfigError as exc:
            return str(exc)
        return "no error"
    finally:
        dist.destroy_process_group()


def test_two_ranks(tmp_path):
    errors = run_ranks(_rank_main, 2, str(tmp_path), timeout=120)
    assert errors == ["rank: 2 does not exist: this run has 2 processes (ranks 0-1)"] * 2
    dumps = load_dump(tmp_path / "all")
    assert sorted(dumps) == [(0, 0), (0, 1)]
    for (_, rank), dump in dumps.items():
        reduce = dump.data["Distributed.all_reduce.0.forward"]
        assert reduce["input_args"][0]["Max"] == rank + 1  # measured before the collective wrote into it
        assert reduce["input_kwargs"] == {} and reduce["output"] == [None]
        assert dump.data["Torch.relu.0.forward"]["input_args"][0]["Max"] == 3.0
    assert sorted(load_dump(tmp_path / "only1")) == [(0, 1)]
    assert not (tmp_path / "bad").exists()
