"""API accuracy pre-check (the predecessor's ``run_ut``), framework-neutral part: cases from a
dump, per-dtype standards and verdicts, the result files, the online checker's protocol and
server. The replay runs in the framework (``load_framework("torch").precheck()``)."""
