"""`python -m kvserve`: the kvserve command (what torchrun -m kvserve runs on every rank)."""
from kvserve.cli import entry

entry()
