"""Operability: what runs beside serving and never inside a step's math. Prometheus registries
(``metrics``), step profiles (``profiling``), server ports (``ports``), the start-up heap kept out
of the garbage collector (``gcpause``), models by Hugging Face id (``hub``), load pictures
(``plot``) and the child processes moeserve starts (``procs``)."""
