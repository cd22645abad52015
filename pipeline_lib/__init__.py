"""alignflow's library: data store, models, losses, sampling, training loops, evaluation.

Never imports prefect, flows or tasks (see STYLE.md)."""
