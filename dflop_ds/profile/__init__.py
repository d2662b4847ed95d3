"""dflop_ds.profile"""
