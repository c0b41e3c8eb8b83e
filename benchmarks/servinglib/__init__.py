"""The serving benchmark's library (``benchmarks/serving.py`` is the command over it).

- ``common``: the repository's root, percentiles, ratios, the git commit, a function in a
  process of its own;
- ``shapes``: the model shapes (scout8, scout48, maverick12, ernie28, tiny), the model folder and
  its sizes (bf16, or FP8 as ``--quantization fp8`` holds them);
- ``cluster``: ``moeserve up`` for one configuration, through ``moeserve.ops.procs.UpProcess``;
- ``clients``: the client processes and the SDK's streaming client;
- ``streams``: one client process's share of a plan (the common start, the records, the deadline);
- ``httpclient``: the HTTP API's streamed completions and their server-sent events;
- ``figures``: the workloads' request plans and the figures of their records;
- ``workloads``: a moeserve configuration's burst and online workloads through each API;
- ``eplb``: the EPLB measurement end to end (``--workloads eplb``);
- ``prefix``: the prefix-caching workloads (``--workloads prefix,multiturn``), the conversations'
  client, their figures and table;
- ``baseline``: transformers' ``generate``;
- ``roofline``: the HBM copy rate and the roofline step time;
- ``profiles``: the ranks' step profiles;
- ``report``: the printed tables.

Imported as ``servinglib`` with ``benchmarks/`` on ``sys.path`` (serving.py puts it there, and
the repository's root for moeserve), so it runs from a bare copy of the repository too.
"""
