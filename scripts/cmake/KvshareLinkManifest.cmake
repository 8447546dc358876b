# What every target of the tree compiles and links, written for scripts/check-layers.py --links
# (the CTest layers_link_check): every library and binary declares exactly the kvshare libraries
# whose headers it includes, so a forgotten or a surplus link fails a test instead of building
# by accident through another library's dependencies (docs/layers.md, "What each binary links").
#
# kvshare_write_link_manifest(FILE) writes one line per compiled target, tab-separated:
#   name  type  folder  sources  LINK_LIBRARIES  INTERFACE_LINK_LIBRARIES
# folder (of the CMakeLists.txt that made it) and sources relative to the source tree; lists
# joined with ";" as CMake keeps them.

function(kvshare_collect_targets directory out)
  get_property(targets DIRECTORY ${directory} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirectories DIRECTORY ${directory} PROPERTY SUBDIRECTORIES)
  foreach(subdirectory IN LISTS subdirectories)
    kvshare_collect_targets(${subdirectory} more)
    list(APPEND targets ${more})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

function(kvshare_write_link_manifest file)
  kvshare_collect_targets(${PROJECT_SOURCE_DIR} targets)
  set(lines "")
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$")
      continue()
    endif()
    get_target_property(source_dir ${target} SOURCE_DIR)
    file(RELATIVE_PATH folder ${PROJECT_SOURCE_DIR} ${source_dir})
    if(folder STREQUAL "")
      set(folder ".")
    endif()
    get_target_property(sources ${target} SOURCES)
    set(relative_sources "")
    foreach(source IN LISTS sources)
      cmake_path(ABSOLUTE_PATH source BASE_DIRECTORY ${source_dir} NORMALIZE)
      cmake_path(RELATIVE_PATH source BASE_DIRECTORY ${PROJECT_SOURCE_DIR})
      list(APPEND relative_sources ${source})
    endforeach()
    get_target_property(links ${target} LINK_LIBRARIES)
    get_target_property(interface_links ${target} INTERFACE_LINK_LIBRARIES)
    foreach(list IN ITEMS links interface_links)
      if(NOT ${list})
        set(${list} "")
      endif()
    endforeach()
    string(APPEND lines "${target}\t${type}\t${folder}\t${relative_sources}\t${links}\t${interface_links}\n")
  endforeach()
  file(WRITE ${file}.new "${lines}")
  # Rewrite only on change: the file is a test input, and its time stamp should mean something.
  file(COPY_FILE ${file}.new ${file} ONLY_IF_DIFFERENT)
  file(REMOVE ${file}.new)
endfunction()
