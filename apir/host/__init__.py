"""The host daemon: sessions in worker processes, a dispatcher onto the local executor."""
