"""dflop_ds.schedule"""
