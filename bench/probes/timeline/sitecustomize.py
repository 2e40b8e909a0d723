"""Probe, not product. With this directory on PYTHONPATH and APIR_PROBE=timeline, every
apir process (the bench, the host daemon and its session workers) appends one line per
event of a prefill-sized step (64+ tokens) to /tmp/apir-timeline-<pid>.txt:
    <guest|host> <event> <CLOCK_MONOTONIC ns> [detail]
It adds no synchronize (an earlier probe that did slowed native too and misled): it only
reads clocks, so both sides keep their own way of waiting. time.perf_counter is
CLOCK_MONOTONIC on Linux, one clock for all processes, so the guest's and the host's
events line up. Events, in order of a step:
    measure-start <backend>   the bench starts a pp test (guest)
    submit-enter / submit-exit  Backend.submit of the guest (remote: the Step is sent)
    recv                      the host's session has parsed the Step
    launched                  the host queued it on the GPU (_start_step returned)
    sync-enter / sync-exit    CopyingBack.result waits for the step (either process)
    gpu <µs>                  CUDA-event time from staging to the end of the replay
    sent                      the host's reply is written
    result                    the guest has the step's outputs
    measure-end <backend>     pp test done, after the backend's synchronize (guest)
With APIR_PROBE_DETAIL=1 also the executor's parts, as <method>< and <method>>.
Read by bench/probes/timeline.py."""

import os
import time

_out = None
_HOST = False


def _log(event: str, detail: str = "") -> None:
    global _out
    if _out is None:
        _out = open(f"/tmp/apir-timeline-{os.getpid()}.txt", "a", buffering=1)
    _out.write(f"{'host' if _HOST else 'guest'} {event} {time.perf_counter_ns()} {detail}\n")


def _patch() -> None:
    import torch

    from apir.backends import remote
    from apir.backends.local import capture, executor
    from apir.bench import runner
    from apir.host import session
    from apir.protocol import messages

    big = {"on": False}  # inside a prefill-sized step (this process)

    measure = runner.measure
    labels = {}  # the bench's models in the order of --backends: native, remote-shm, remote-tcp

    def timed_measure(model, test, prompt):
        label = labels.setdefault(id(model), f"{len(labels)}:{model.backend.name}")
        big["on"] = test.kind == "pp"
        if big["on"]:
            _log("measure-start", label)
        s = measure(model, test, prompt)
        if big["on"]:
            _log("measure-end", label)
        big["on"] = False
        return s

    runner.measure = timed_measure

    def wrap_submit(cls):
        submit = cls.submit

        def timed_submit(self, gid, inputs, feed=None):
            n = next((a.shape[0] for a in inputs.values() if getattr(a, "ndim", 0)), 0)
            on = n >= 64
            if on:
                _log("submit-enter", cls.__name__)
            p = submit(self, gid, inputs, feed)
            if on:
                _log("submit-exit", cls.__name__)
                if cls is remote.RemoteBackend:
                    result = p.result

                    def timed_result():
                        r = result()
                        _log("result")
                        return r

                    p.result = timed_result
            return p

        cls.submit = timed_submit

    wrap_submit(remote.RemoteBackend)
    wrap_submit(executor.LocalBackend)

    parse_step = messages.parse_step

    def timed_parse(body):
        fields = parse_step(body)
        big["on"] = fields[1] >= 64
        if big["on"]:
            _log("recv", str(fields[1]))
        return fields

    messages.parse_step = timed_parse
    start = session.Session._start_step

    def timed_start(self, rid, *fields):
        r = start(self, rid, *fields)
        if big["on"]:
            _log("launched")
        return r

    session.Session._start_step = timed_start
    send = session.Session._send

    def timed_send(self, msg, rid):
        ok = send(self, msg, rid)
        if big["on"]:
            _log("sent")
            big["on"] = False
        return ok

    session.Session._send = timed_send

    events = {}
    call = capture.CapturedStep.__call__

    def timed_call(self, inputs):
        n = next((a.shape[0] for a in inputs.values() if a.ndim), 0)
        if n < 64:
            return call(self, inputs)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = call(self, inputs)
        b.record()
        events["last"] = (a, b)
        return out

    capture.CapturedStep.__call__ = timed_call
    result = executor.CopyingBack.result

    def timed_result(self):
        if not big["on"] or self._copies is None:
            return result(self)
        _log("sync-enter")
        r = result(self)
        _log("sync-exit")
        if "last" in events:
            a, b = events.pop("last")
            _log("gpu", f"{a.elapsed_time(b) * 1000:.0f}")
        return r

    executor.CopyingBack.result = timed_result

    # APIR_PROBE_DETAIL=1: the parts of the executor's submit, each as <name>< and <name>>
    if os.environ.get("APIR_PROBE_DETAIL") == "1":
        from apir.backends import accounting

        def wrap(cls, name):
            fn = getattr(cls, name)

            def timed(*args, **kwargs):
                if not big["on"]:
                    return fn(*args, **kwargs)
                _log(f"{name}<")
                r = fn(*args, **kwargs)
                _log(f"{name}>")
                return r

            setattr(cls, name, timed)

        for cls, name in [(executor.LocalBackend, "_launch"), (executor.LocalBackend, "_pending"),
                          (executor.LocalBackend, "_run"), (executor.LocalBackend, "_replay"),
                          (accounting.Ledger, "check"), (capture.CapturedStep, "_stage"),
                          (torch.cuda.CUDAGraph, "replay")]:
            wrap(cls, name)


if os.environ.get("APIR_PROBE") == "timeline":
    import sys

    _HOST = "host" in sys.argv
    try:
        _patch()
    except ImportError:  # not an apir process with torch
        pass
