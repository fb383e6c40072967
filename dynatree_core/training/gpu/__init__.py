"""The one-sitting GPU recipe (`make draft-gpu`, `python -m dynatree_core.training draft-gpu`): a
prompt pack in, the feature draft and its card out, every stage resumable within a wall-time budget.

- recipe.py     the stages (answers, follow, relabel, train, quality, export) and the budget split
- book.py       the run directory's record of what each stage has done (RUN/stages.json)
- answering.py  the pack's jobs and the follow-up turns decoded shard by shard into the run's store
- settings.py   the stages in order, one run's settings and the command line its card shows
- commands.py   the `draft-gpu` command

May import: errors, core, runs, drafts, drafting, decoding, measure, and the training packages
beside it (answers/, packed/, the loop, the card).
"""
