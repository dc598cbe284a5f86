"""Supervised trainers on one shared base: SFT and the Bradley–Terry reward model."""
