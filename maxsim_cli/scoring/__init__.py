"""Scoring on one device in one process, in layers:

- `request`: `ScoreRequest`, every option of a run, and their checks;
- `plan`: pure planning, from document lengths and a memory budget to query and document batches;
- `engine`: runs a plan over an open corpus (stream, kernels, top-k, OOM halving) into a sink;
- `files`: a whole run from files to a run file; `devices`, `stats`: the device options, `ScoreStats`.

Nothing here knows about jobs of several ranks (`maxsim_cli.parallel`), which wrap `engine.run`.
"""
