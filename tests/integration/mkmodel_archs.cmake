# mkmodel_archs: each non-plain memory kind kvshare-mkmodel writes (mamba2 recurrent, lfm2 and
# qwen35 hybrid, gemma3 iSWA) loaded and served by a real llama-server (LLAMA_SERVER=path),
# which must build that memory and answer a greedy completion. Exit 77 = skipped (no
# LLAMA_SERVER; with CI=true that fails instead).
add_test(NAME mkmodel_archs
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/mkmodel_archs.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(mkmodel_archs PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS llama_server)
