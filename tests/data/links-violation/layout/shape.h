// The lowest library: includes nothing of ours.
#pragma once
int shape_rows();
