"""`graph` output in the real viewers and on foreign dumps: a TensorBoard server with the
tb-graph-ascend plugin queried over HTTP and shot with headless Chromium; the HTML report in
headless Chromium; dumps of the predecessor (msprobe.pytorch) and of MindSpore."""
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from graph_helpers import PERTURBED, dump
from msprobe_engine.analysis.graph import build_graphs, write_outputs
from msprobe_engine.analysis.graph.tensorboard import tensorboard_command

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium")
BLOCK = "Module.blocks.1.Block.forward.0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"chromium-{time.monotonic_ns()}"
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """A comparison in run `compare` and an overflow-checked build of two steps in run `overflow`
    of one logdir; the comparison's files."""
    root = tmp_path_factory.mktemp("graph")
    result = build_graphs(dump(root / "target", "L0", gain=3.0), dump(root / "ref", "L0"))
    write_outputs(build_graphs(dump(root / "nan", "L0", gain=float("nan"), steps=2), overflow_check=True),
                  root / "logdir" / "overflow")
    return write_outputs(result, root / "logdir" / "compare")


class Plugin:
    """The graph_ascend plugin's HTTP endpoints."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}/data/plugin/graph_ascend/"

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return r.read()

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())


@pytest.fixture(scope="module")
def tensorboard(comparison):
    port = _free_port()
    log = open(comparison["vis_db"].parent.parent / "tensorboard.log", "w")
    command = tensorboard_command(comparison["vis_db"].parent.parent)  # what `graph` prints
    proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    plugin = Plugin(port)
    try:
        for _ in range(120):
            try:
                plugin.get("load_meta_dir")
                break
            except OSError:
                assert proc.poll() is None, (comparison["vis_db"].parent.parent / "tensorboard.log").read_text()
                time.sleep(0.5)
        yield port, plugin
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_the_plugin_serves_our_hierarchy_and_diff(comparison, tensorboard):
    _, plugin = tensorboard
    runs = json.loads(plugin.get("load_meta_dir"))["data"]
    run = comparison["vis_db"].parent.name
    tag = comparison["vis_db"].name[:-len(".vis.db")]
    assert runs[run] == {"type": "db", "tags": [tag]} and set(runs) == {"compare", "overflow"}
    plugin.get(f"loadGraphData?run={run}&tag={tag}&type=db")
    meta = {"run": run, "tag": tag, "type": "db", "lang": "en", "microStep": -1, "rank": 0, "step": 0}
    config = plugin.post("loadGraphConfigInfo", {"metaData": meta})["data"]
    assert config["isSingleGraph"] is False and config["steps"] == [0] and config["ranks"] == [0]
    nodes = plugin.post("loadGraphAllNodeList", {"metaData": meta})["data"]
    assert PERTURBED in nodes["npuNodeList"] and nodes["npuMatchNodes"][PERTURBED] == PERTURBED
    assert nodes["npuUnMatchNodes"] == [] and nodes["benchUnMatchNodes"] == []

    top = plugin.post("changeNodeExpandState", {"nodeInfo": {"nodeName": "root", "nodeType": "NPU"},
                                                "metaData": meta})["data"]
    assert top["DefaultModel"]["isRoot"] and top[BLOCK]["parentNode"] == "DefaultModel"
    assert top[BLOCK]["precisionIndex"] == 1  # contains the divergence
    assert top["Module.blocks.0.Block.forward.0"]["precisionIndex"] == 0
    opened = plugin.post("changeNodeExpandState", {"nodeInfo": {"nodeName": BLOCK, "nodeType": "NPU"},
                                                   "metaData": meta})["data"]
    assert opened[PERTURBED]["parentNode"] == BLOCK and opened[PERTURBED]["precisionIndex"] == 1
    assert opened[PERTURBED]["matchedNodeLink"] == ["DefaultModel", BLOCK, PERTURBED]

    info = plugin.post("getNodeInfo", {"nodeInfo": {"nodeName": PERTURBED, "nodeType": "NPU"}, "metaData": meta})
    out = info["data"]["npu"]["output_data"][f"{PERTURBED}.output.0"]
    assert out["Result"] == "error" and out["NormRelativeErr"].startswith("200.0000")
    assert info["data"]["bench"]["node_name"] == PERTURBED
    found = plugin.post("screen", {"metaData": meta, "type": "precision", "values": [[0.6, 1]]})["data"]
    assert found[0] == PERTURBED  # leaves in execution order: the first divergence comes first


def test_the_plugin_serves_a_single_graph_of_two_steps_with_overflow_marks(tensorboard):
    _, plugin = tensorboard
    (tag,) = json.loads(plugin.get("load_meta_dir"))["data"]["overflow"]["tags"]
    plugin.get(f"loadGraphData?run=overflow&tag={tag}&type=db")
    # step 0: the scale layer makes the nan from good inputs; step 1: the update made the parameters nan
    for step, level, first in ((0, "critical", PERTURBED), (1, "high", "Module.blocks.0.fc.Linear.forward.0")):
        meta = {"run": "overflow", "tag": tag, "type": "db", "lang": "en", "microStep": -1, "rank": 0, "step": step}
        config = plugin.post("loadGraphConfigInfo", {"metaData": meta})["data"]
        assert config["isSingleGraph"] is True and config["steps"] == [0, 1] and config["overflowCheck"] is True
        top = plugin.post("changeNodeExpandState", {"nodeInfo": {"nodeName": "root", "nodeType": "Single"},
                                                    "metaData": meta})["data"]
        assert top[BLOCK]["parentNode"] == "DefaultModel" and top[BLOCK]["precisionIndex"] is None
        found = plugin.post("screen", {"metaData": meta, "type": "overflow", "values": [level]})["data"]
        assert found[0] == first  # leaves in execution order


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
def test_a_screenshot_of_the_graph_page(tensorboard, tmp_path):
    port, _ = tensorboard
    png = tmp_path / "graph_ascend.png"
    done = _chromium(tmp_path, f"--screenshot={png}", "--window-size=1600,1200", "--virtual-time-budget=15000",
                     f"http://127.0.0.1:{port}/#graph_ascend")
    assert png.is_file() and png.stat().st_size > 10_000, done.stderr[-2000:]
    print(f"screenshot: {png}")


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
def test_the_html_report_shows_the_first_divergence_and_search_finds_a_node(comparison, tmp_path):
    url = comparison["html"].resolve().as_uri() + "#search=scale"
    page = _chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", url).stdout
    assert f'id="first-divergence" class="div" data-node="{PERTURBED}"' in page
    assert f"First divergence: {BLOCK} &gt; {PERTURBED}" in page
    results = page.split('<ul id="results">')[1].split("</ul>")[0]
    assert f'data-node="{PERTURBED}"' in results and 'data-node="Module.blocks.0.scale.Scale.forward.0"' in results
    assert 'data-node="Module.blocks.0.fc.Linear.forward.0"' not in results
    page = _chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom",
                     comparison["html"].resolve().as_uri() + f"#node={PERTURBED}").stdout
    assert f'<div id="info" data-node="{PERTURBED}"><h3>{PERTURBED}</h3>' in page and "200.0000" in page


PREDECESSOR_DUMP = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[3])
    from graph_helpers import Net, train
    from msprobe.pytorch import PrecisionDebugger
    import torch
    torch.manual_seed(0)
    config = sys.argv[1] + ".json"
    json.dump({"task": "statistics", "dump_path": sys.argv[1], "rank": [], "step": [], "level": "L0"},
              open(config, "w"))
    debugger = PrecisionDebugger(config_path=config)
    train(Net(gain=float(sys.argv[2])), 1, lambda m: debugger.start(model=m), debugger.stop, debugger.step)
""")


def _predecessor_dump(root: Path, gain: float) -> Path:
    done = subprocess.run([sys.executable, "-c", PREDECESSOR_DUMP, str(root), str(gain), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (rank_dir,) = root.glob("step0/*/")  # the predecessor names it proc<pid> (rank<N> when distributed)
    return rank_dir


def test_a_dump_of_the_predecessor_gives_the_same_graph_and_divergence(tmp_path):
    ref, target = _predecessor_dump(tmp_path / "ref", 1.0), _predecessor_dump(tmp_path / "target", 3.0)
    result = build_graphs(target, ref)
    (graph,) = result.targets
    assert graph.first_divergence == PERTURBED
    assert graph.ancestors(PERTURBED) == ["DefaultModel", BLOCK]
    assert graph.nodes["DefaultModel"].contains_divergence and graph.nodes[BLOCK].contains_divergence
    assert result.structures[0].same
    ours = build_graphs(dump(tmp_path / "ours", "L0")).targets[0]
    forward = {n for n in ours.nodes if ".forward." in n}
    assert {n for n in graph.nodes if ".forward." in n} == forward  # same hierarchy as our own dump
    assert all(graph.nodes[n].parent == ours.nodes[n].parent for n in forward)


MINDSPORE_DUMP = textwrap.dedent("""
    import sys
    import numpy as np, mindspore as ms
    from mindspore import Tensor, nn
    from msprobe_engine.frameworks.mindspore.capture.session import MindSporePrecisionDebugger

    class Block(nn.Cell):
        def __init__(self, gain):
            super().__init__()
            self.fc, self.act, self.gain = nn.Dense(4, 4), nn.ReLU(), gain
        def construct(self, x):
            return self.act(self.fc(x)) * self.gain

    class Net(nn.Cell):
        def __init__(self, gain):
            super().__init__()
            self.b0, self.b1, self.head = Block(1.0), Block(gain), nn.Dense(4, 1)
        def construct(self, x):
            return self.head(self.b1(self.b0(x)))

    loss = nn.MSELoss()
    for name, gain in (("ref", 1.0), ("target", 3.0)):  # one process: MindSpore takes long to import
        ms.set_seed(0)
        net = Net(gain)
        debugger = MindSporePrecisionDebugger({"task": "statistics", "dump_path": f"{sys.argv[1]}/{name}",
                                               "level": "L0"})
        grad_fn = ms.value_and_grad(lambda x, y: loss(net(x), y), None, net.trainable_params())
        debugger.start(net)
        _, grads = grad_fn(Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)),
                           Tensor(np.zeros((2, 1), np.float32)))
        debugger.stop()
        debugger.step(grads)
        debugger.close()
""")


def test_a_mindspore_dump_gives_a_graph_of_its_cells(tmp_path):
    done = subprocess.run([sys.executable, "-c", MINDSPORE_DUMP, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-3000:]
    result = build_graphs(tmp_path / "target", tmp_path / "ref")
    (graph,) = result.targets
    assert graph.nodes["Cell.b1.fc.Dense.forward.0"].parent == "Cell.b1.Block.forward.0"
    assert graph.nodes["Cell.b1.fc.Dense.backward.0"].parent == "Cell.b1.Block.backward.0"
    assert graph.first_divergence == "Cell.b1.Block.forward.0"  # its own code scales: its children are fine
    assert graph.nodes["Cell.b1.fc.Dense.forward.0"].precision == 0
    assert graph.nodes["DefaultModel"].contains_divergence
