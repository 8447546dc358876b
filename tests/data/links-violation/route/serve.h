// Includes nothing of ours, while the route links kvshare PUBLIC.
#pragma once
int serve();
