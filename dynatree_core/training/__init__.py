"""Training the drafts (`python -m dynatree_core.training COMMAND`; `make draft`, `make draft-feature`).

One loop (trainer.py: warm-up + cosine schedule, gradient clip, eval cadence, checkpoint and
resume (resume.py), the compute ledger (ledger.py)) that every recipe calls with its loss and
batches; one subpackage per recipe, each with its `commands.py` (the CLI's table is __main__.py,
its shared flags cli.py):

- token/     the token draft (`make draft`): on-policy samples, labelled windows, KD, quality, export
- feature/   the feature draft's KD on stored features (`train-feature`), agreement by depth,
             `export-feature`
- answers/   the data the heads train on: offline sources, the target's answers with features,
             written text, answer windows and the reduced vocabulary
- packed/    the cheap step over packed answer windows (`train-packed`): the shipped feature and
             fused drafts
- gpu/       the one-sitting GPU recipe (`draft-gpu`): a prompt pack to an exported feature draft,
             every stage resumable within a wall-time budget
- prompts.py the project's own prompts (token samples, answer sources), read from
             assets/draft-data/prompts.json
- card.py    the model card of every shipped draft (`export`, `export-feature`)

Removed recipes (lost in BENCHMARKS.md, nothing ships from them): docs/training.md says which
and at which commit they can be found.

May import: errors, core, forward, runs, verify, drafts, drafting, decoding, measure.
"""
