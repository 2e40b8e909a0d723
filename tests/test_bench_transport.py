"""``apir bench transport`` against the test daemon: every figure is there, for the
plain and the pipelined decode step and the prefill-sized one."""

from __future__ import annotations

from pathlib import Path

from apir.bench.transport import markdown, measure


def test_transport_bench_measures_plain_and_pipelined_steps(host):
    results = measure([host.unix, host.tcp], Path(host.token_file).read_text().strip(), calls=50, upload_mb=1, native_device="cpu")
    assert [r.transport for r in results] == ["native", "unix-shm", "tcp"]
    native, *remotes = results
    assert native.null_p50_us is None and native.upload_gbps is None
    assert native.step_overhead_us == native.pipelined_overhead_us == native.prefill_overhead_us == 0
    for r in remotes:
        assert r.null_p50_us > 0 and r.upload_gbps > 0 and r.step_overhead_us is not None
        assert 0 < r.pipelined_p50_us <= r.pipelined_p99_us and r.pipelined_overhead_us is not None
        assert r.prefill_p50_us > 0 and r.prefill_overhead_us is not None
    table = markdown(results)
    assert "pipelined step p50 (µs)" in table and "512-token step p50 (µs)" in table
    assert len(table.splitlines()) == 5 and all(line.count("|") == 13 for line in table.splitlines())
