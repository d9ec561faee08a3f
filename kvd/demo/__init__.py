"""Launchers over the reference engine: they start daemons (or patch one), so they stand beside
:mod:`kvd.cli` rather than in :mod:`kvd.engine`, which speaks to a daemon only as a client.

* :mod:`~kvd.demo.run` -- ``kvd demo``: a prefill and a decode node on loopback, proven against
  the colocated run;
* :mod:`~kvd.demo.faults` -- test-only faults that misplace KV (negative controls), in a sending
  daemon or in a ticket; ``python -m kvd.demo.faults NAME serve ...``.
"""
