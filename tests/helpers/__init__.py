"""What the fault, security, privacy and load tests call (their fixtures are in tests/conftest.py):
subprocesses (processes), a listener on every topic (recording), scripted devices (scripted), a
file system filled to the brim (disk)."""
