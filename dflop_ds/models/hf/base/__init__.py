"""What every HF family builds on: template tokenisation, the media dataset and its collates, the
vision / projector / decoder layer wrappers, packed attention and the synthetic contract microbatches.
No module here imports a family."""
