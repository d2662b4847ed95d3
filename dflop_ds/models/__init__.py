"""dflop_ds.models"""
