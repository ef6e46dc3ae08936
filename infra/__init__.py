"""Operating tokenbus: the ``tokenbus`` command (``cli``), the embedded development stack
(``devstack``), the administration commands (``admin``) and the load generator (``loadgen``)."""
