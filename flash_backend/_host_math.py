"""Host-side block arithmetic of the launchers.

In Triton 3.6 `triton.cdiv` and `triton.next_power_of_2` are ConstexprFunction objects: called from host
code they unwrap their arguments first, ~2 us a call on our CPU machine, more on the H200 host, and an eager
attention forward + backward made six such calls. These are the plain functions underneath (the same code,
so SymInts under tracing behave as before).
"""

import triton

cdiv = getattr(triton.cdiv, "fn", triton.cdiv)
next_power_of_2 = getattr(triton.next_power_of_2, "fn", triton.next_power_of_2)
