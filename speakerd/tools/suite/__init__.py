"""`python -m speakerd.tools.suite NAME [NAME ...]`: the project's one benchmark harness.

Every figure the README and docs/performance.md quote comes from one of its suites
(`--list` names them), written as records of one schema (`record.py`) so that each figure
carries the commit, GPU, driver and CUDA it was measured on, the exact command, and the
anchor timed in the same run. Suites run the project's own commands (`speakerd bench`,
`serve`, `client verify`, `client load`, pytest) as child processes and turn their JSON into
records; the harness adds budgets, skip lines and the one schema, not a second way to
measure.
"""
