"""dflop_ds.data"""
