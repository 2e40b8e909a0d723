"""``apir vm``: the guest in a QEMU/KVM virtual machine, remoted over ivshmem shared memory.

image  – builds and caches the guest's kernel + initramfs (no torch, no GPU)
launch – boots it under QEMU (KVM, TCG fallback) and serves its one session
host   – the host end of the shared region: handshake checks, then the session worker
guest  – the guest's init: mount, find the ivshmem devices, run apir, power off
cli    – the ``apir vm build | run | bench`` subcommands
"""
