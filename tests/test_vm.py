"""VM shared memory: the ivshmem ring transport without a VM (threads and processes
sharing a temp file), and ``apir vm run`` in a real QEMU/KVM guest (marked ``vm``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from hosts import WAIT
from tiny_models import TinyConfig, write_tiny_gguf

import apir
from apir.engine import SamplingParams
from apir.protocol import ProtocolError
from apir.protocol import messages as m
from apir.transport import ConnectionClosed
from apir.transport.ivshmem import find_region
from apir.transport.shm import (
    _REP_HEAD,
    _REQ_HEAD,
    _REQ_TAIL,
    DATA,
    Region,
    RegionError,
    RingChannel,
)


@pytest.fixture
def region(tmp_path):
    r = Region.create(tmp_path / "region", 4 << 20, ring_size=4096)
    yield r
    r.close()


def pair(region, **kw):
    return RingChannel(region, "guest", **kw), RingChannel(Region.open(region_path(region)), "host", **kw)


def region_path(region) -> str:
    return f"/proc/self/fd/{region.fd}"


def test_frames_round_trip_and_wrap_around(region):
    guest, host = pair(region, timeout=WAIT)
    big = bytes(range(256)) * 40  # 10 KiB: larger than the 4 KiB ring, so it streams and wraps
    got = []

    def serve():
        for _ in range(50):
            f = host.recv()
            got.append(f.message)
            host.send(m.Data(m.Blob(f.message.data.inline, -1, f.message.data.size)), f.header.request_id)

    t = threading.Thread(target=serve)
    t.start()
    for i in range(50):
        payload = big[: 100 + i * 200]
        guest.send(m.SetTensor(1, i, m.Blob(payload, -1, len(payload))), i, m.WANT_REPLY)
        reply = guest.recv()
        assert reply.header.request_id == i and reply.message.data.inline == payload
    t.join(WAIT)
    assert len(got) == 50 and guest.head > 20 * 4096  # wrapped many times


def test_hostile_head_is_a_protocol_error(region):
    guest, host = pair(region, timeout=1)
    guest.send(m.Ok())
    host.recv()
    region.store(_REQ_HEAD, host.tail + 4096 + 1)  # claims more bytes than the ring holds
    with pytest.raises(ProtocolError, match="out of range"):
        host.recv()
    region.store(_REQ_HEAD, 0)  # moves backwards
    with pytest.raises(ProtocolError, match="out of range"):
        host.recv()


def test_hostile_tail_is_a_protocol_error(region):
    guest, host = pair(region, timeout=1)
    region.store(_REQ_TAIL, 1 << 40)  # "read" bytes the guest never wrote
    with pytest.raises(ProtocolError, match="tail"):
        guest.send(m.Ok())


def test_hostile_frame_length_is_a_protocol_error(region):
    guest, host = pair(region, timeout=1)
    host.max_body = 100
    guest.send(m.SetTensor(1, 0, m.Blob(b"x" * 200, -1, 200)))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        host.recv()


def test_garbage_frame_header_is_a_protocol_error(region):
    host = RingChannel(region, "host", timeout=1)
    region.view[DATA : DATA + 16] = b"EVIL" + bytes(12)
    region.store(_REQ_HEAD, 16)
    with pytest.raises(ProtocolError, match="magic"):
        host.recv()


def test_timeouts_and_closed_peer(region):
    guest, host = pair(region, timeout=0.2, io_timeout=0.2)
    with pytest.raises(TimeoutError):
        host.recv()
    # half a frame, then silence: the rest must come within io_timeout
    frame = m.encode(m.Ok(), 1)
    region.view[DATA : DATA + 8] = frame[:8]
    region.store(_REQ_HEAD, 8)
    guest.head = 8
    with pytest.raises(TimeoutError):
        host.recv()
    # a reply that never drains: the writer gives up after io_timeout
    with pytest.raises(TimeoutError):
        for _ in range(1000):
            host.send(m.Data(m.Blob(b"y" * 1000, -1, 1000)))
    guest.close()
    h2 = RingChannel(region, "host", timeout=5)
    h2.tail = region.load(_REQ_HEAD)
    with pytest.raises(ConnectionClosed):
        h2.recv()
    assert region.load(_REP_HEAD) > 0


def test_bad_regions_are_refused(tmp_path):
    with pytest.raises(RegionError, match="power of two"):
        Region.create(tmp_path / "r", 3 << 20)
    (tmp_path / "junk").write_bytes(b"\0" * 65536)
    with pytest.raises(RegionError, match="magic"):
        Region.open(tmp_path / "junk")
    with pytest.raises(RegionError, match="no ivshmem PCI device"):
        find_region(tmp_path)


def test_remote_backend_over_a_region_file_in_another_process(tmp_path):
    """The whole stack (handshake, session worker, arena) with the host in a child process:
    greedy tokens equal the local backend's."""
    model = str(write_tiny_gguf(tmp_path / "tiny.gguf", TinyConfig(), "F16", seed=3))
    path = tmp_path / "region"
    host = Region.create(path, 32 << 20)
    code = (
        "import sys; from apir.transport.shm import Region; from apir.vm.host import serve_region\n"
        f"sys.exit(0 if serve_region(Region.open({str(path)!r}), 'cpu', handshake_timeout=60) else 3)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        params = SamplingParams(temperature=0, max_tokens=24)
        with apir.load(model, backend="local", device="cpu") as local:
            ids = local.tokenize("Hello world")
            want = list(local.generate_ids(ids, params))
        with apir.load(model, backend="remote", remote=f"ivshmem://{path}") as remote:
            assert list(remote.generate_ids(ids, params)) == want
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        host.close()


def test_version_mismatch_is_refused(tmp_path):
    path = tmp_path / "region"
    region = Region.create(path, 8 << 20)
    from apir.vm.host import serve_region

    guest = RingChannel(Region.open(path), "guest", timeout=10)
    guest.send(m.Hello(99, b"", "", "test", 0), 0, m.WANT_REPLY)
    assert serve_region(region, "cpu", handshake_timeout=5) is False
    reply = guest.recv().message
    assert isinstance(reply, m.Error) and "version" in reply.message


# ---------------------------------------------------------------- a real VM


def _vm_skip() -> str | None:
    if not os.path.exists("/dev/kvm"):
        return "no /dev/kvm: the VM test needs KVM"
    if not shutil.which("qemu-system-x86_64"):
        return "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"
    return None


@pytest.mark.vm
@pytest.mark.skipif(_vm_skip() is not None, reason=_vm_skip() or "")
def test_vm_greedy_output_equals_local():
    argv = ["-p", "The capital of France is", "-n", "16", "--temp", "0"]
    cli = [sys.executable, "-m", "apir.cli"]
    local = subprocess.run([*cli, "run", *argv, "--device", "cpu"], capture_output=True, text=True,
                           timeout=300)
    assert local.returncode == 0, local.stderr
    t0 = time.monotonic()
    vm = subprocess.run([*cli, "vm", "run", *argv, "--device", "cpu"], capture_output=True, text=True,
                        timeout=1500)
    assert vm.returncode == 0, vm.stderr[-3000:]
    assert vm.stdout == local.stdout, vm.stderr[-3000:]
    print(f"apir vm run took {time.monotonic() - t0:.1f}s", file=sys.stderr)
