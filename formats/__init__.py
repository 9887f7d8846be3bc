"""On-disk layouts of tokpack. The bottom layer: imports nothing else from the project. Each
name is imported from its module (`tokpack.formats.errors`, `constants`, `reading`...); this
package imports none of them, so that importing a light one (`constants`, `errors`) does not
import numpy (`import packer` stays light, tests/test_api.py)."""
