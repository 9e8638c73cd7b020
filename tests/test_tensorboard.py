"""TensorBoard as a user sees it: the demo's run, served by a real tensorboard server (the
command the demo prints), read through its HTTP data API, and the landing page rendered by
headless Chromium. Plus the layout and heatmap pieces on their own."""
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from msprobe_engine.config import ConfigError, load_config

from msprobe_engine.run_dir import RUN_NAME_ENV
from msprobe_engine.sinks.heatmap import MISSING_RGB, NAN_RGB, POS_INF_RGB, heatmap_rgb, png
from msprobe_engine.sinks.tb_layout import build_layout, layer_pattern
from msprobe_integrations.torch import TorchMonitor
from tests.multiproc import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS, INJECT_AT, LAYER = 60, 40, "layers.1.mlp.0"
CHROMIUM = shutil.which("chromium")


def decode_png(data: bytes) -> np.ndarray:
    """[height, width, 3] of an 8-bit RGB PNG without filters (what the sink writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks.setdefault(kind, b"")
        chunks[kind] += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any()
    return rows[:, 1:].reshape(height, width, 3)


# ---- pieces ---------------------------------------------------------------------------------
def test_layout_puts_the_same_sublayer_of_every_layer_in_one_chart():
    layers = 32
    tags = [f"grad/model.layers.{i}.mlp.down_proj.weight/norm" for i in range(layers)]
    tags += [f"actv/model.layers.{i}/output/norm" for i in range(layers)] + ["grad/lm_head.weight/norm",
                                                                           "grad/model.embed.weight/norm"]
    layout = build_layout(tags, ["Health/loss", "Health/open_alert/spike"])
    titles = [c.title for c in layout.category]
    assert titles == ["Health", "grad norm", "actv output norm"]
    grad = {chart.title: chart.multiline.tag[0] for chart in layout.category[1].chart}
    assert list(grad) == ["grad norm: model.layers.*.mlp.down_proj.weight", "grad norm: other"]
    every_layer = grad["grad norm: model.layers.*.mlp.down_proj.weight"]
    assert [t for t in tags if re.match(every_layer, t)] == tags[:layers]
    assert [t for t in tags if re.match(grad["grad norm: other"], t)] == tags[-2:]
    assert layer_pattern("transformer.h.11.attn.c_attn") == "transformer.h.*.attn.c_attn"


def test_heatmap_marks_non_finite_and_missing_cells_and_is_a_valid_png():
    norms = np.array([[1.0, 10.0, 100.0], [np.nan, np.inf, -np.inf], [0.0, 1e-3, 1e3]])
    rgb = heatmap_rgb(norms)
    assert tuple(rgb[1, 0]) == NAN_RGB and tuple(rgb[1, 1]) == POS_INF_RGB and tuple(rgb[1, 2]) == MISSING_RGB
    brightness = rgb.astype(int).sum(axis=2)
    assert brightness[2, 0] < brightness[0, 0] < brightness[0, 1] < brightness[0, 2] <= brightness[2, 2]
    assert np.array_equal(decode_png(png(rgb)), rgb)


def test_histograms_of_the_layer_norms_on_request_and_bad_keys_named(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = {"name": "tensorboard", "histograms": True, "heatmap_every": 2}
    monitor = TorchMonitor(model, optimizer, {"output_dir": str(tmp_path), "run_name": "h", "sinks": [sink]})
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step_end()
    monitor.close()
    events = EventAccumulator(str(tmp_path / "h" / "rank0"), size_guidance={"histograms": 0, "tensors": 0}).Reload()
    assert set(events.Tags()["histograms"]) == {"hist/actv_log10_norm", "hist/grad_log10_norm"}
    grads = events.Histograms("hist/grad_log10_norm")
    assert [h.step for h in grads] == [0, 1, 2] and all(h.histogram_value.num == 4 for h in grads)  # 4 parameters
    heatmaps = {tag: [t.step for t in events.Tensors(tag)] for tag in events.Tags()["tensors"] if tag.startswith("Heatmap/grad")}
    # every 2 monitored steps, and the last one at close: a tag per window (each its own legend)
    assert heatmaps == {"Heatmap/grad_norm/steps_0-1": [1], "Heatmap/grad_norm/steps_0-2": [2]}
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.heatmap_every"):
        load_config({"sinks": [{"name": "tensorboard", "heatmap_every": -1}]})
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.layer_kinds"):
        load_config({"sinks": [{"name": "tensorboard", "layer_kinds": ["train"]}]})


# ---- the demo, served ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if k != RUN_NAME_ENV}
    done = subprocess.run([sys.executable, "-m", "examples.demo", "--output-dir", str(out), "--steps", str(STEPS),
                           "--inject-step", str(INJECT_AT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    command = re.search(r"see it in TensorBoard:\s+(.+)", done.stdout).group(1)
    run = Path(re.search(r"^run: (.+)$", done.stdout, re.M).group(1)).name + "/rank0"  # the label: the run's name
    return {"out": out, "stdout": done.stdout, "stderr": done.stderr, "command": command, "run": run}


@pytest.fixture(scope="module")
def server(demo):
    port = free_port()
    process = subprocess.Popen(shlex.split(demo["command"]) + ["--port", str(port)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if demo["run"] in get(base, "/data/runs"):
                    break
            except OSError:
                pass
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "tensorboard did not serve the run in 120 s"
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def get(base: str, path: str, **query: str):
    url = base + path + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read()
    return json.loads(body) if response.headers.get_content_type() == "application/json" else body


@pytest.mark.slow
def test_the_demo_prints_its_run_progress_and_events(demo):
    out = demo["stdout"]
    assert re.search(rf"step {STEPS // 5}/{STEPS}\s+loss", out)
    run_dir = Path(re.search(r"^run: (.+)$", out, re.M).group(1))
    assert run_dir.parent == demo["out"] and re.fullmatch(r"\d{8}-\d{6}", run_dir.name)
    assert f"ended at step {INJECT_AT + 1} after 1 step; last value" in out
    assert "after 1 step:" in demo["stderr"] and "at its last firing" in demo["stderr"]


@pytest.mark.slow
def test_tensorboard_serves_the_overview_first_and_the_layers_compared(server, demo):
    assert get(server, "/data/runs") == [demo["run"]]
    listing = get(server, "/data/plugins_listing")
    assert all(listing[name]["enabled"] for name in ("scalars", "custom_scalars", "images", "text"))
    tags = list(get(server, "/data/plugin/scalars/tags")[demo["run"]])
    health = sorted(t for t in tags if t.startswith("Health/"))
    assert {"Health/loss", "Health/grad_norm", "Health/non_finite/actv", "Health/non_finite/grad",
            "Health/worst_deviation", "Health/skipped", "Health/open_alert/non_finite", "Health/monitor_ms"} <= set(health)
    assert sorted(tags)[0].startswith("Health/")  # TensorBoard sorts groups by name: Health first
    per_layer = [t for t in tags if t.split("/")[0] in ("actv", "grad") and t != "grad/global/norm"]
    assert per_layer and all(t.endswith("/norm") for t in per_layer)  # layer_stats: [norm]
    assert not any(t.startswith(("optim/", "param/")) for t in tags)  # layer_kinds: [actv, grad]

    alert = get(server, "/data/plugin/scalars/scalars", run=demo["run"], tag="Health/open_alert/non_finite")
    assert [step for _, step, _ in alert] == list(range(STEPS))  # every monitored step
    assert [step for _, step, value in alert if value == 1.0] == [INJECT_AT]
    skipped = get(server, "/data/plugin/scalars/scalars", run=demo["run"], tag="Health/skipped")
    assert [step for _, step, value in skipped if value == 1.0] == [INJECT_AT]

    layout = get(server, "/data/plugin/custom_scalars/layout")
    assert layout["category"][0]["title"] == "Health"
    grad = next(c for c in layout["category"] if c["title"] == "grad norm")
    chart = next(c for c in grad["chart"] if c["title"] == "grad norm: layers.*.mlp.0.weight")
    assert sorted(t for t in tags if re.match(chart["multiline"]["tag"][0], t)) == \
        ["grad/layers.0.mlp.0.weight/norm", "grad/layers.1.mlp.0.weight/norm"]


@pytest.mark.slow
def test_tensorboard_shows_the_incident_and_the_heatmap(server, demo):
    assert get(server, "/data/plugin/text/tags") == {demo["run"]: ["Health/incident"]}
    [entry] = get(server, "/data/plugin/text/text", run=demo["run"], tag="Health/incident")
    text = entry["text"]
    assert entry["step"] == INJECT_AT
    incident = next(demo["out"].glob(f"*/incidents/step{INJECT_AT}-rank0-non_finite"))
    for expected in ("non_finite", f"<code>{LAYER}</code> (Linear, forward)", "<td>skip</td>", "reproducible",
                     str(incident), "Top deviations", f"actv/{LAYER}/output"):
        assert expected in text

    images = get(server, "/data/plugin/images/tags")[demo["run"]]
    # one tag per kind and window of steps: the incident's, every 50, the end (the last heatmap_steps=100)
    windows = [f"steps_0-{last}" for last in (INJECT_AT, 49, STEPS - 1)]
    assert set(images) == {f"Heatmap/{kind}_norm/{window}" for kind in ("actv", "grad") for window in windows}
    for tag, image in images.items():  # each legend is its own image's
        first, last = map(int, tag.rsplit("_", 1)[1].split("-"))
        assert f"Steps {first}..{last} left to right" in image["description"], (tag, image["description"])
        assert ("Non-finite rows: <code>" in image["description"]) == (last >= INJECT_AT), tag  # the nan's window
        [shown] = get(server, "/data/plugin/images/images", run=demo["run"], tag=tag, sample="0")
        assert shown["step"] == last
    tag = f"Heatmap/actv_norm/steps_0-{INJECT_AT}"
    [shown] = get(server, "/data/plugin/images/images", run=demo["run"], tag=tag, sample="0")
    pixels = decode_png(get(server, "/data/plugin/images/individualImage?" + shown["query"]))
    rows = re.findall(r"(\d+): <code>([^<]+)</code>", images[tag]["description"])
    names = [name for _, name in rows]
    height, width = pixels.shape[:2]
    cell_h, cell_w = height // len(names), width // (INJECT_AT + 1)  # steps 0..40

    def cell(name, column):
        return tuple(pixels[names.index(name) * cell_h + cell_h // 2, column * cell_w + cell_w // 2])

    assert cell(LAYER, INJECT_AT) == NAN_RGB  # the first nan, at the incident's step
    assert cell(LAYER, INJECT_AT - 1) != NAN_RGB and cell("layers.0.mlp.0", INJECT_AT) != NAN_RGB


@pytest.mark.slow
def test_the_landing_page_opens_on_the_health_group(server, demo, tmp_path):
    assert CHROMIUM, "chromium is not on PATH (the test set-up installs Debian's chromium)"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1600,1200", "--virtual-time-budget=15000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", server + "/"], capture_output=True, text=True,
                         timeout=180).stdout
    groups = re.findall(r'class="group-title"[^>]*title="([^"]+)"', dom)
    assert groups[0] == "Health", groups  # the first group under Pinned
    # the cards drawn on the first screen (the rest are drawn when scrolled to), in order
    cards = re.findall(r'class="tag"[^>]*title="(Health/[^"]+)"', dom)
    # the first row: the alerts so far and the loss (the per-rule Health/open_alert/* sort after them)
    assert {"Health/alerts", "Health/loss"} <= set(cards[:3]), cards
    assert f">{demo['run']}<" in dom.replace(" ", "")  # the run is labelled with its name
    shot = tmp_path / "landing.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", server + "/"], capture_output=True, timeout=180)
    width, height = struct.unpack(">II", shot.read_bytes()[16:24])
    assert (width, height) == (1600, 1200)
    # a tall window draws the Heatmap group too: each card's window of steps is the step it shows
    tall = [flag if not flag.startswith("--window-size") else "--window-size=1600,4000" for flag in flags]
    dom = subprocess.run([CHROMIUM, *tall, "--dump-dom", server + "/"], capture_output=True, text=True,
                         timeout=180).stdout
    heatmaps = re.findall(r'title="Heatmap/(\w+)_norm/steps_(\d+)-(\d+)".*?Step (\d+)', dom, re.S)
    assert sorted((kind, last) for kind, _, last, _ in heatmaps) == \
        sorted((kind, str(last)) for kind in ("actv", "grad") for last in (INJECT_AT, 49, STEPS - 1)), heatmaps
    assert all(first == "0" and shown == last for _, first, last, shown in heatmaps), heatmaps


def test_tensorboard_verb_names_a_missing_logdir_in_one_line_and_leaves_the_trend_plugin_out(tmp_path, capsys):
    from msprobe_engine.cli import main
    from msprobe_engine.sinks.tb_server import TREND_PLUGIN, unique_plugins

    assert main(["tensorboard", "--logdir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--logdir {tmp_path / 'missing'}: no such directory" in err
    names = [getattr(p, "plugin_name", None) for p in unique_plugins(tmp_path)]
    assert TREND_PLUGIN not in names and names.count("graph_ascend") <= 1
    (tmp_path / "run.trend.db").write_bytes(b"")  # the predecessor's own database: its plugin is wanted
    with_trend = [getattr(p, "plugin_name", None) for p in unique_plugins(tmp_path)]
    assert TREND_PLUGIN in with_trend and len(with_trend) == len(names) + 1
