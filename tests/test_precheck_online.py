"""Online pre-check: a real checker process on localhost, training processes sending to it."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import precheck_helpers as helpers
from msprobe_engine.analysis.precheck.client import CheckerClient
from msprobe_engine.analysis.precheck.protocol import CASE, HELLO, hello, write_frame
from msprobe_engine.analysis.precheck.transport import TcpTransport
from msprobe_engine.cli import main
from msprobe_engine.frameworks.torch.precheck.online import OnlinePrecheck
from test_precheck import APIS as DUMPED_APIS
from test_precheck import read_rows

#: the calls the online sender sees: as the dump's, but operators under the API they dispatch to
#: (`x * y` is `Tensor.mul`: the dump's dunder names come from its operator shadowing, which the
#: online capture does not install)
APIS = [name.replace("Tensor.__mul__", "Tensor.mul") for name in DUMPED_APIS]

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
KILLED_TRAINING = """
import os, signal, sys, time
import torch, precheck_helpers as helpers
from msprobe_engine.frameworks.torch.precheck.online import OnlinePrecheck
torch.manual_seed(0)
model = helpers.GeluNet()
sender = OnlinePrecheck(port=int(sys.argv[1]), white_list=("linear",)).start()
model(torch.randn(8, 16), torch.randint(0, 8, (8,))).backward()
while sender.client.sent < 2:
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_step(sender: OnlinePrecheck | None = None) -> torch.Tensor:
    """A training step of `GeluNet`; its forward and backward with `sender` started."""
    torch.manual_seed(0)
    model, x, target = helpers.GeluNet(), torch.randn(8, 16), torch.randint(0, 8, (8,))
    if sender is not None:
        sender.start()
    loss = model(x, target)
    loss.backward()
    if sender is not None:
        sender.stop()
    return loss.detach()


def lossy_step(**where: object) -> OnlinePrecheck:
    """One step with the lossy GELU, its calls sent to the checker `where` says; the closed sender."""
    helpers.install()
    try:
        sender = OnlinePrecheck(**where)
        one_step(sender)
        sender.close()
    finally:
        helpers.uninstall()
    return sender


@pytest.mark.slow
def test_online_flags_the_lossy_api_and_survives_a_killed_sender(tmp_path):
    server = subprocess.Popen([sys.executable, "-m", "msprobe_engine", "run_ut", "--online", "--port", "0",
                               "-o", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV)
    try:
        first = server.stdout.readline()
        assert "listening on 127.0.0.1:" in first, server.stderr.read()
        port = int(first.split("127.0.0.1:")[1].split(";")[0])
        with socket.create_connection(("127.0.0.1", port)) as raw:  # a sender dying inside a frame
            write_frame(raw, HELLO, hello("torch", None))
            raw.sendall(CASE + (1000).to_bytes(8, "big") + b"partial")
        killed = subprocess.run([sys.executable, "-c", KILLED_TRAINING, str(port)], env=ENV, timeout=120,
                                capture_output=True, text=True)
        assert killed.returncode == -signal.SIGKILL, killed.stderr

        sender = lossy_step(port=port)
        assert (sender.client.sent, sender.client.dropped) == (len(APIS), 0)
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, err
    assert "went away without closing" in err
    assert "2 connection(s) lost" in out, err
    rows = read_rows(next((tmp_path / "out").glob("accuracy_checking_result_*.csv")))
    assert set(rows) == set(APIS)  # the killed sender's linear calls share names with the second run's
    # forward: the training's own (lossy) GELU output; backward: rerun by the checker (real GELU)
    assert rows.pop("Functional.gelu.0")[:2] == ["error", "pass"]
    assert all(r[:2] == ["pass", "pass"] for r in rows.values()), rows


def test_absent_checker_is_reported_and_training_goes_on(caplog):
    expected = one_step()
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="msprobe_engine"):
        sender = OnlinePrecheck(port=port)
        losses = [one_step(sender) for _ in range(3)]
        sender.close()
    assert all(torch.equal(loss, expected) for loss in losses)
    assert f"cannot reach the checker at 127.0.0.1:{port}" in caplog.text
    assert "run_ut --online" in caplog.text
    assert sender.client.sent == 0 and sender.client.dropped == 3 * len(APIS)


def test_port_in_use_is_a_clear_error(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["run_ut", "--online", "--port", str(port), "-o", str(tmp_path)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in capsys.readouterr().err


def test_full_queue_drops_and_counts_without_blocking():
    release = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def checker() -> None:  # reads until the sender half-closes, as the real one does
            conn, _ = listener.accept()
            with conn:
                while conn.recv(1 << 16):
                    pass

        reading = threading.Thread(target=checker)
        reading.start()

        def slow_encode(item: int) -> bytes:
            release.wait(30)
            return b"x"

        client = CheckerClient(TcpTransport("127.0.0.1", listener.getsockname()[1]), "torch", slow_encode,
                               queue_size=2)
        accepted = [client.submit(i) for i in range(10)]
        release.set()
        client.close()
        reading.join(30)
    assert sum(accepted) <= 3 and client.dropped == 10 - sum(accepted)
    assert client.sent == sum(accepted)


@pytest.mark.slow
def test_tls_checker(tmp_path):
    """The documented TLS set-up: a self-signed certificate, the sender verifying it."""
    from msprobe_engine.analysis.precheck.runner import PrecheckConfig
    from msprobe_engine.analysis.precheck.server import CheckerServer

    tls = tmp_path / "tls"
    tls.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(tls / "server.key"),
                    "-out", str(tls / "server.crt")], check=True, capture_output=True, timeout=60)
    server = CheckerServer(tmp_path / "out", PrecheckConfig(host="127.0.0.1", port=0, tls_path=str(tls)))
    serving = threading.Thread(target=server.serve)
    serving.start()
    try:
        sender = OnlinePrecheck(host="localhost", port=server.port, tls_ca=str(tls / "server.crt"))
        one_step(sender)
        sender.close()
    finally:
        server.stop()
        serving.join(60)
    assert sender.client.error is None and sender.client.sent == len(APIS)
    assert set(read_rows(server.report.result_path)) == set(APIS)


def test_shared_directory_mode(tmp_path):
    """The predecessor's nfs_path: case files in a directory the checker watches."""
    from msprobe_engine.analysis.precheck.runner import PrecheckConfig
    from msprobe_engine.analysis.precheck.server import CheckerServer

    shared = tmp_path / "shared"
    shared.mkdir()
    server = CheckerServer(tmp_path / "out", PrecheckConfig(nfs_path=str(shared)))
    serving = threading.Thread(target=server.serve)
    serving.start()
    try:
        sender = lossy_step(nfs_path=shared)
    finally:
        server.stop()
        serving.join(60)
    assert (sender.client.sent, sender.client.dropped) == (len(APIS), 0)
    rows = read_rows(server.report.result_path)
    assert set(rows) == set(APIS) and rows["Functional.gelu.0"][0] == "error"
    assert all(r[0] == "pass" for name, r in rows.items() if name != "Functional.gelu.0")
    assert list(shared.iterdir()) == []  # every case file checked and removed, the end marker too
