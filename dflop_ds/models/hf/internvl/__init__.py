"""The InternVL family (dynamic tiles with a thumbnail, pixel shuffle, videos as frames)."""
