"""Seeded sweeps over config fields (`ppo-jax-sweep`): `spec` (what runs), `runner` (one process per
run, resumable), `results` (mean ± 95% CI over seeds, CSV and Markdown), `plots` (learning curves with
bands, one summary figure per swept field)."""
