"""`maxsim score` on several devices: rank threads on the GPUs of one machine, or processes joined by
torch.distributed on one machine or many.

A job is ``W`` ranks that share one corpus. Every rank opens the whole corpus (headers and ids: this
checks that ids are unique across all shards; rank threads share one opened corpus), takes its share of
the shards, scores its share against *all* queries with the single-process engine
(`maxsim_cli.scoring.engine.run`, given a copy of the job's `ScoreRequest` with the rank's device), and
sends its results to rank 0, which merges them and alone writes the run. Exhaustive results travel as
two arrays per rank (float32 scores and corpus ordinals, ``[queries, k]``, 12 B a result), merged on rank
0 with the engine's order keys and written by the run writer's columnar path, as one process writes
them; rerank results per query. This package is the layer above the engine: it never calls
`maxsim_cli.scoring.entry.score`, which calls it.

**Shares.** Shards are dealt largest first (by token count; ties by shard order) to the rank with the
fewest tokens so far (ties to the lowest rank). With shard token counts ``t_s`` and total ``T``, this
greedy rule (LPT) gives a largest share of at most ``T / W + max_s t_s``, so shards well below ``T / W``
tokens balance the ranks; a rank left without shards (``W`` > number of shards) scores nothing.

**Exactness.** Exhaustive mode: rank ``r`` keeps the best ``k`` documents of its shards per query in the
total order "float32 score descending, docno descending" (trec_eval's). The corpus-wide best ``k`` are
among the union of the ranks' best ``k``, and a document's score does not depend on the batch or rank it
was scored in, so rank 0 selecting the best ``k`` of the union in the same order writes exactly the bytes
of a single-process run. Rerank mode: rank ``r`` scores the candidates that live in its shards; a
candidate in no shard at all is reported by rank 0 alone (the warning, and the ``--strict`` error on every
rank), with the counts and examples a single process would give. Queries are written in the query file's
order, queries without results left out, as in one process.

**Failure.** Each rank catches its own error and all ranks exchange a status (``all_gather_object``)
before anything is written: if any rank failed, rank 0 raises that rank's one-line error (prefixed with
the rank and device unless it is rank 0's own), ranks other than 0 exit with the same code without a
message, and no run is written. A rank that dies (killed) never reaches the exchange: the launcher
(``--devices``) or torchrun's agent stops the other ranks; ranks on other machines give up after the
process group's timeout. The run is written atomically by rank 0 after every rank has finished, and
SIGTERM raises `SystemExit` in a rank so that a rank stopped while writing removes its temporary file.

**Launching.** Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the rank's device is
``cuda:LOCAL_RANK`` (``--device auto`` or ``cuda``) or the CPU (``--device cpu``). ``--devices 0,1`` or
``all`` runs a rank per GPU as a thread of this process (`run_threads`): no interpreter, import or
corpus opening is repeated, and results are merged in memory. ``--devices cpu:N`` starts N worker
processes itself on this machine, joined through a TCP store that the launcher holds (the same
environment contract as torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), and the launcher's exit code
is the job's. **Failure** of rank threads: the failing rank sets a stop that the others check after
every batch (`maxsim_cli.errors.RankStopped`), and the job raises the failing rank's error.

**Lifetime of ``--devices cpu:N`` workers.** The workers die with their launcher, however it ends
(`maxsim_cli.lifeline`: a death signal from the kernel and a thread watching the parent); rank 0 checks
that the launcher is still there before it writes the run, so no run appears after the job failed.
SIGINT and SIGHUP go to the launcher alone (workers ignore them); it stops the workers with SIGTERM,
then SIGKILL after `TERMINATE_GRACE_S`. Rank 0 notes the temporary file of the run it writes in the
job's folder, so that a launcher whose rank 0 was killed removes exactly that file, and notes there
that the run is in place (`COMMIT_NOTE`, at its commit point: `maxsim_cli.lifeline`): a stop signal to
the launcher from then on, or one that came during that rename, leaves the job's result its own. A
worker that finds its launcher gone removes the job's folder (its few files) on its way out; one that
had already finished cannot, and a launcher killed by SIGKILL removes nothing, so the job's folder holds
a lock file that the launcher and its workers keep locked while any of them runs (`launcher.lock_job`), and a
job starting removes the folders whose lock is free (`remove_stale_job_folders`).

The modules, by job: `environment` (what a job's environment says, the job folder's names),
`devices` (``--devices`` lists, a rank's device), `shares` (a rank's results, candidate splits and the
merge arithmetic), `work` (one rank's share scored by the engine), `ranks` (torch.distributed ranks),
`write` (rank 0's merge and the run written once), `threads` (rank threads on the GPUs of this process),
`resident` (a corpus resident on several devices), `launcher` (``--devices cpu:N``: worker processes and
their job folder) and `worker` (the worker program, ``python -m maxsim_cli.parallel.worker``).
Nothing is imported here, so that a worker ties its lifeline before torch is loaded.
"""
