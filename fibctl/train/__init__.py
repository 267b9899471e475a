"""Training: the recipe (optim), the data (sampler), checkpoints, the loop (trainer), workers.

One concern per module; `trainer` composes the others and reports through the small
`Reporter` protocol that the database layer implements, so nothing here writes SQL.
"""
