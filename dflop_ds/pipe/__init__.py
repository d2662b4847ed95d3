"""dflop_ds.pipe"""
