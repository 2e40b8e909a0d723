"""``apir bench``: llama-bench-style throughput of one model over several backends.

synthetic  random-weight llama models of real shapes (no download)
backends   backend name -> factory (native, guest-cpu, remote-shm, remote-tcp)
runner     the pp/tg tests, interleaved over backends, with warm-up and repetitions
report     records -> markdown / json / jsonl / csv; the history file
compare    two result files side by side, failing on a regression
plot       grouped bars per test and the remote-overhead curve (matplotlib)
cli        the ``apir bench`` and ``apir bench compare`` subcommands
"""
