"""twistd plugin: ``twistd -n roomstore --db URL [options]`` runs the
replication server with the options of ``roomstore serve``
(``roomstore/twistd_plugin.py``).

``pip install .`` installs this file into ``twisted/plugins/`` in
site-packages (setup.cfg lists ``twisted.plugins`` as a namespace package),
where Twisted finds it from any directory. This folder must stay without an
``__init__.py``: it would replace Twisted's own ``twisted/plugins/__init__.py``.
"""

from roomstore.twistd_plugin import serviceMaker

__all__ = ["serviceMaker"]
