"""Utilities every layer may use: file writing, size limits, threads, the machine a result ran on,
and the one-line error format of the commands. Nothing here imports the rest of qkmla."""
