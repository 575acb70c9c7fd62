# A package, so that the live servers in conftest.py are shared by every module here
# (pytest's "package" scope) and stopped when the last of them is done.
