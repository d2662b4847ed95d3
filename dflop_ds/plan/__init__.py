"""dflop_ds.plan"""
