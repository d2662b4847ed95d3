"""Files a framework imports by path (``swift sft --external_plugins FILE``).

ms-swift puts a plugin file's folder first on ``sys.path``; this folder holds nothing whose name
could shadow a package (a ``swift.py`` beside the plugin would hide ms-swift itself).
"""
