"""Probe models record their task; Table 2 groups by it.

A probe model's scores (aux_metrics name 'marked_retrieval') gain a `task` metric whose text
names the task it was trained and scored on: its length, vocabulary and distances. Scores of
different tasks are not comparable, and Table 2 no longer pools them. Probe models recorded
before this revision get it from their stored config.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import json

import sqlalchemy as sa
from alembic import op

from fibctl.probe.cells import PROBE_METRICS, task_label

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

aux = sa.table("aux_metrics", sa.column("run_id", sa.Integer), sa.column("name", sa.String),
               sa.column("metric", sa.String), sa.column("value", sa.Float), sa.column("text", sa.Text))
runs = sa.table("runs", sa.column("id", sa.Integer), sa.column("config_json", sa.Text))


def upgrade() -> None:
    conn = op.get_bind()
    scored = sa.select(aux.c.run_id).where(aux.c.name == PROBE_METRICS).distinct()
    labelled = sa.select(aux.c.run_id).where(aux.c.name == PROBE_METRICS, aux.c.metric == "task")
    rows = conn.execute(sa.select(runs.c.id, runs.c.config_json)
                        .where(runs.c.id.in_(scored), runs.c.id.not_in(labelled))).all()
    for run_id, config_json in rows:
        config = json.loads(config_json)
        # the distances the model was scored at (its acc_d<D> metrics): for an imported study
        # model these are the study's, whatever its stored recipe says
        distances = sorted(int(m[len("acc_d"):]) for (m,) in conn.execute(
            sa.select(aux.c.metric).where(aux.c.run_id == run_id, aux.c.name == PROBE_METRICS,
                                          aux.c.metric.like("acc_d%"))))
        label = task_label(config["model"]["seq_len"], config["model"]["vocab_size"],
                           distances or config.get("probe", {}).get("distances", []))
        conn.execute(aux.insert().values(run_id=run_id, name=PROBE_METRICS, metric="task", value=None, text=label))


def downgrade() -> None:
    op.execute(aux.delete().where(aux.c.name == PROBE_METRICS, aux.c.metric == "task"))
